"""`import loopkit` is cheap: after `import torch` it imports loopkit's own package and the standard library, nothing
else (transformers, accelerate, matplotlib, ...: each name is imported on first use), and never HF Trainer's modules.

What is checked is which modules an import loads, in a fresh interpreter (a module imported once is cached for the rest
of a process): that is what makes an import slow, and it reads the same on a quiet machine and a busy one. How many
seconds the imports take, loopkit's beside HF Trainer's, is measured by the benchmark (`python -m benchmarks --only
startup`, "import framework").
"""

import json
import sys

from helpers import run_process

HF_TRAINER_MODULES = ("transformers.trainer", "transformers.training_args", "transformers.trainer_callback")


def probe(statement: str) -> list[str]:
    """In a fresh interpreter that has imported torch: the modules `statement` adds to `sys.modules`."""
    code = ("import json, sys\n"
            "import torch\n"
            "before = set(sys.modules)\n"
            f"{statement}\n"
            "print(json.dumps(sorted(set(sys.modules) - before)))\n")
    result = run_process([sys.executable, "-c", code], f"a fresh interpreter running {statement!r}")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def foreign(modules: list[str]) -> list[str]:
    """The modules that are neither loopkit's own nor the standard library's."""
    return [m for m in modules if m.split(".")[0] not in ("loopkit", *sys.stdlib_module_names)]


def test_import_loopkit_loads_only_its_own_modules_and_no_hf_trainer_module():
    added = probe("import loopkit")
    loaded = [m for m in HF_TRAINER_MODULES if m in added]
    assert loaded == [], f"`import loopkit` imported {loaded}: keep these imports lazy (inside functions)"
    packages = sorted({m.split(".")[0] for m in foreign(added)})
    assert packages == [], (
        f"`import loopkit` imported {len(foreign(added))} modules of {packages} after torch. Keep them lazy (imported "
        f"where used; see loopkit/__init__.py), and run `python -X importtime -c 'import loopkit'` to see which import "
        f"pulls them in.")
    assert "loopkit" in added


def test_the_probe_sees_hf_trainer_and_what_it_imports():
    """Both checks above can fail: importing HF's Trainer shows all of its modules and the packages beyond the
    standard library it pulls in (transformers, accelerate, ...)."""
    # transformers exports lazily; touching the class forces its module in.
    added = probe("from transformers import Trainer\nTrainer.__name__")
    assert set(HF_TRAINER_MODULES) <= set(added)
    assert {"transformers", "accelerate"} <= {m.split(".")[0] for m in foreign(added)}
