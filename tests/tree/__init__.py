"""Unit tests of the pure tree library (services/tree)."""
