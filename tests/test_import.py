"""`import loopkit` is cheap: it never loads HF Trainer's modules, and costs at most 0.3 s over `import torch`.

Each measurement runs in a fresh interpreter (a module imported once is cached for the rest of a process). torch is
imported first, untimed, and only what the statement adds is timed: on a busy machine `import torch` alone can take
seconds, and subtracting two such numbers would blur a budget of tenths of a second. The loopkit timing is the best
of several runs, so another process using the CPU at the same moment does not make the test fail.
"""

import json
import subprocess
import sys

HF_TRAINER_MODULES = ("transformers.trainer", "transformers.training_args", "transformers.trainer_callback")
IMPORT_BUDGET_S = 0.3
RUNS = 3


def probe(statement: str) -> tuple[float, list[str]]:
    """In a fresh interpreter that has imported torch: the seconds `statement` takes, and which of
    `HF_TRAINER_MODULES` are loaded afterwards."""
    code = ("import json, sys, time\n"
            "import torch\n"
            "start = time.perf_counter()\n"
            f"{statement}\n"
            "seconds = time.perf_counter() - start\n"
            f"print(json.dumps([seconds, [m for m in {HF_TRAINER_MODULES!r} if m in sys.modules]]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    seconds, loaded = json.loads(result.stdout.strip().splitlines()[-1])
    return seconds, loaded


def test_import_loopkit_is_cheap_and_loads_no_hf_trainer_module():
    runs = [probe("import loopkit") for _ in range(RUNS)]
    loaded = runs[0][1]
    assert loaded == [], f"`import loopkit` imported {loaded}: keep these imports lazy (inside functions)"
    overhead = min(seconds for seconds, _ in runs)
    assert overhead <= IMPORT_BUDGET_S, (
        f"`import loopkit` adds {overhead:.3f} s to `import torch` (best of {RUNS}); the budget is "
        f"{IMPORT_BUDGET_S} s. Run `python -X importtime -c 'import loopkit'` to see which import is to blame, and "
        f"make it lazy.")


def test_the_probe_sees_hf_trainer_and_its_cost():
    """Both checks above can fail: importing HF's Trainer shows up in sys.modules and costs more than the budget."""
    # transformers exports lazily; touching the class forces its module in.
    seconds, loaded = probe("from transformers import Trainer\nTrainer.__name__")
    assert set(loaded) == set(HF_TRAINER_MODULES)
    assert seconds > IMPORT_BUDGET_S
