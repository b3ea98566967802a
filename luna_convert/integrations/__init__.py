"""Integrations with other libraries (sentence-transformers)."""
