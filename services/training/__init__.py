"""Drafter training pipeline: self-distilled data generation, feature extraction, training."""
