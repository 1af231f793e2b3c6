"""Helpers shared by tests and scripts: the scheduler simulator (no model) and the HF
transformers oracle."""
