"""Micro- and end-to-end benchmarks; each script prints a human table, then one JSON line."""
