"""How each contender runs a workload: the hand-written loop, HF Trainer and loopkit, the peers (benchmarks/README.md,
"Layout"). The parent process imports `names` only (torch-free); the others run in the workers."""
