"""Modules a converted model holds: the linear-attention layer (``attention``)."""
