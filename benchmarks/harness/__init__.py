"""How a run is carried out: the suite's settings and worker processes, the worker, the environment, the host-read
counter (benchmarks/README.md, "Layout")."""
