"""Verifier: owns the target model, each request's KV cache and the decode loop."""
