"""The TRL benchmark (benchmarks/suite/trl.py, issue 42 item 5): its verdict and parity logic on synthetic rounds
(fast), and `python -m benchmarks --size tiny --only trl` end to end (worker processes: load-sensitive tier).
No test asserts a speed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `benchmarks/` lives in the repository, next to the installed loopkit
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import BENCHMARKS  # noqa: E402
from benchmarks.suite import trl as bench_trl  # noqa: E402
from helpers import run_process  # noqa: E402


def test_below_trl_only_when_every_round_is_below():
    below = bench_trl.verdict([9.0, 8.0, 9.5], [10.0, 10.0, 10.0])
    assert below["below_every_round"] and below["text"] == "below TRL in every round (0.800-0.950x)"
    # one round of three above TRL: no verdict, and the rounds are counted each way
    mixed = bench_trl.verdict([9.0, 10.5, 9.5], [10.0, 10.0, 10.0])
    assert not mixed["below_every_round"]
    assert mixed["text"] == "rounds disagree: below TRL in 2 of 3 rounds (0.900-1.050x): no verdict"
    above = bench_trl.verdict([11.0, 12.0, 10.5], [10.0, 10.0, 10.0])
    assert not above["below_every_round"] and above["text"].startswith("ABOVE TRL in every round (1.050-1.200x)")
    equal = bench_trl.verdict([10.0, 10.0], [10.0, 10.0])
    assert not equal["below_every_round"] and equal["text"] == "equal to TRL in every round"
    # a race on different work gets no verdict, however the numbers look
    other_work = bench_trl.verdict([1.0, 1.0], [10.0, 10.0], same_work=False)
    assert not other_work["below_every_round"] and other_work["text"].startswith("no verdict")
    one = bench_trl.verdict([9.0], [10.0])
    assert one["below_every_round"] and one["text"] == "below TRL in every round (0.900x, one round)"


def test_parity_compares_every_logged_key_of_every_entry():
    history = [{"loss": 10.3, "grad_norm": 1.77, "num_tokens": 5079.0, "step": 5},
               {"train_loss": 10.2, "step": 10}]
    assert bench_trl.parity(history, [dict(e) for e in history])["ok"]
    close = [dict(history[0], loss=10.3 * (1 + 5e-6)), history[1]]
    assert bench_trl.parity(history, close)["ok"]
    far = [dict(history[0], loss=10.3 * (1 + 5e-5)), history[1]]
    result = bench_trl.parity(history, far)
    assert not result["ok"] and result["detail"].startswith("entry 0 loss") and result["max_loss_relative"] > 1e-5
    other_key = [dict(history[0], grad_norm=1.8), history[1]]
    assert bench_trl.parity(history, other_key)["detail"].startswith("entry 0 grad_norm")
    missing = [{k: v for k, v in history[0].items() if k != "num_tokens"}, history[1]]
    assert bench_trl.parity(history, missing)["detail"] == "different log entries or keys"
    assert bench_trl.timing_key("train_runtime") and bench_trl.timing_key("train_samples_per_second")
    assert not bench_trl.timing_key("train_loss")


def synthetic_section(loopkit_cpu: list) -> dict:
    """A results section with three rounds whose loopkit CPU times are `loopkit_cpu` (TRL's: 10 ms each)."""
    settings = {"model": {"num_hidden_layers": 2, "hidden_size": 128}, "batch_size": 8, "max_length": 128,
                "warmup_steps": 5, "timed_steps": 30, "logging_steps": 5, "num_reviews": 2048, "rounds": 3}
    history = [{"loss": 10.0, "step": 5}]

    def reply(contender, index, cpu):
        return {"trainer": contender, "cpu_ms_per_step": cpu, "wall_ms_per_step": cpu * 2, "peak_rss_mb": 1000.0,
                "train_peak_mb": 500.0 - (contender == "loopkit"), "load_average_before": 1.0 + index,
                "load_average": 2.0, "log_history": history}

    runs = {w: {"trl": [reply("trl", i, 10.0) for i in range(3)],
                "loopkit": [reply("loopkit", i, cpu) for i, cpu in enumerate(loopkit_cpu)]}
            for w in bench_trl.WORKLOADS}
    section = {"title": bench_trl.TITLE, "rows": [], "plan": settings, "runs": runs}
    section["workloads"] = {w: bench_trl.summarise(runs[w]) for w in bench_trl.WORKLOADS}
    return section


def test_the_table_names_every_measure_that_is_not_below_trl_in_every_round():
    below = bench_trl.markdown(synthetic_section([9.0, 9.0, 9.0]))
    # peak RSS of the process equal in every round: named; train() growth 1 MB below: not named
    assert ("Rounds where loopkit is not below TRL, or that disagree: SFT, plain text, padded batches, peak RSS of "
            "the process; SFT, packing=True, peak RSS of the process;") in below
    assert "train() growth" not in below.split("Rounds where")[1].split("\n")[0]
    assert "| SFT packed | CPU time per optimizer step, ms | 10.0 (10.0-10.0) | 9 (9-9) | 0.900, 0.900, " \
           "0.900 | below TRL in every round (0.900-0.900x) |" in below
    assert "load average (1 min) 1.0-3.0 over the runs" in below
    mixed = bench_trl.markdown(synthetic_section([9.0, 11.0, 9.0]))
    assert "rounds disagree: below TRL in 2 of 3 rounds (0.900-1.100x): no verdict" in mixed
    assert "DPO, sigmoid loss, explicit reference model, CPU time per optimizer step" in mixed.split("Rounds where")[1]


def test_the_benchmark_is_registered():
    from benchmarks.__main__ import parse_args

    assert "trl" in BENCHMARKS
    assert parse_args(["--only", "trl"]).selected == ["trl"]


@pytest.mark.skipif(bench_trl.missing_trl() is not None, reason="trl is not installed")
def test_the_command_runs_the_trl_benchmark_tiny_with_the_same_logs(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                         if p]))
    finished = run_process([sys.executable, "-m", "benchmarks", "--size", "tiny", "--only", "trl",
                            "--out", str(tmp_path)], "python -m benchmarks --size tiny --only trl", cwd=REPO_ROOT,
                           env=env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    section = json.loads((tmp_path / "results.json").read_text())["benchmarks"]["trl"]
    assert list(section["workloads"]) == bench_trl.TINY_WORKLOADS
    for workload in bench_trl.TINY_WORKLOADS:
        assert section["workloads"][workload]["same_work"], section["workloads"][workload]["parity"]
        trainers = [section["runs"][workload][c][0]["trainer"] for c in bench_trl.CONTENDERS]
        assert trainers == (["DPOTrainer", "DPOLoop"] if workload.startswith("dpo") else ["SFTTrainer", "SFTLoop"])
        for contender in bench_trl.CONTENDERS:
            run = section["runs"][workload][contender][0]
            assert run["global_step"] == section["plan"]["warmup_steps"] + section["plan"]["timed_steps"]
            assert run["cpu_ms_per_step"] > 0 and run["peak_rss_mb"] > 0
            assert len(run["losses"]) == run["global_step"]  # logging every step at the tiny size
    assert "| SFT packed (debates) | CPU time per optimizer step, ms |" in (tmp_path / "results.md").read_text()
