"""loopkit's benchmarks against HF Trainer and a hand-written PyTorch loop. Run `python -m benchmarks --help`.

Each benchmark is a module `benchmarks/suite/<name>.py` with a parent-side `run(suite)` (schedules contenders in
worker processes and returns a result section), an optional `markdown(section)` and `chart(section, plt)`, and the
worker-side task functions the workers call.
"""

BENCHMARKS = ("overhead", "startup", "eval_memory", "resume", "checkpoint", "finetune", "ladder", "ladder_debates",
              "ladder_hamlet", "compile", "chunked_loss", "trl")
