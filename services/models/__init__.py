"""Model locations: the default target (SmolLM2 from a PyPI package) and the shipped drafter."""
