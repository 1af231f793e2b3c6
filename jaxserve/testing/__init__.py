"""Helpers shared by tests and scripts: the scheduler simulator (no model), ragged attention
metadata for kernel checks, and the HF transformers oracle."""
