"""What the benchmarks train: the run spec, the models, the data, the checks and the ladder (benchmarks/README.md,
"Layout"). The parent process imports `spec` and `ladder` (torch-free); the others run in the workers."""
