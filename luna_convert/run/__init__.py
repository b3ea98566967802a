"""A run: its config (recipes, defaults for your own data), teachers, the convert-and-train pipeline, comparisons
and what a run folder holds."""
