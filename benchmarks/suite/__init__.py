"""Each benchmark of `python -m benchmarks`, one module per benchmark (benchmarks/README.md, "Layout")."""
