"""Where time goes, each profile its own command (benchmarks/README.md, "Layout")."""
