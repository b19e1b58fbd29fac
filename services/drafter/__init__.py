"""Drafter: owns the DFlash drafter, the Domino correction head and per-request drafter contexts."""
