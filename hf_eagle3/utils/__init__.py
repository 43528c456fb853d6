"""Helpers every layer may use: what identifies a model, a tokenizer or a file (`fingerprint`)."""
