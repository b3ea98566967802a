"""A run, stage by stage, and what its folder holds. Which module holds what: CONTRIBUTING.md, *Package map*."""
