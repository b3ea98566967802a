"""Tools over converted models and run folders: benchmarks, reports, attention maps."""
