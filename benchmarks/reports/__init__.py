"""What is made of the results: statistics and verdicts, tables and charts, and the docs' generated sections
(benchmarks/README.md, "Layout")."""
