"""Smoke tests of the benchmark harness (`python -m benchmarks`, issue 6) on a tiny size: it runs end to end, the
three contenders do the same work, and the reports are written. No test asserts a speed. The per-step benchmark's
peers (Lightning's Trainer and Fabric, pytorch-ignite: loopkit's `bench` extra) run where they are installed; where
one is not, the benchmark says so and runs the rest, and the peers' own test is skipped with that reason.

One test drives the real command (worker processes, JSON over pipes) on the per-step benchmark; the other runs
every other benchmark's schedule, checks and report in this process, with each worker task called directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `benchmarks/` lives in the repository, next to the installed loopkit
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import BENCHMARKS  # noqa: E402
from benchmarks.contenders.names import CONTENDERS, LABELS, PEERS, missing_peers  # noqa: E402
from benchmarks.harness.environment import describe  # noqa: E402
from benchmarks.harness.runner import Suite  # noqa: E402
from benchmarks.harness.worker import call  # noqa: E402
from benchmarks.reports.tables import comparison_table, write_charts, write_json, write_markdown  # noqa: E402
from helpers import run_process  # noqa: E402


def test_the_command_runs_the_per_step_benchmark_and_writes_the_reports(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                         if p]))
    missing = missing_peers()  # the worker processes see the same packages
    finished = run_process([sys.executable, "-m", "benchmarks", "--size", "tiny", "--only", "overhead",
                            "--out", str(tmp_path)], "python -m benchmarks --size tiny --only overhead", cwd=REPO_ROOT,
                           env=env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["environment"]["versions"]["torch"]
    rows = results["benchmarks"]["overhead"]["rows"]
    assert [row["name"] for row in rows] == ["near-null model (16x16 linear)", "near-null model (16x16 linear), CPU "
                                             "time", "tiny LlamaForCausalLM", "tiny LlamaForCausalLM, CPU time",
                                             "setup, imports done: trainer built to end of step 1 (tiny "
                                             "LlamaForCausalLM)"]
    assert results["benchmarks"]["overhead"]["peers_missing"] == missing
    for peer, reason in missing.items():  # a missing peer: one line, and the rest runs
        assert f"overhead: {LABELS[peer]} skipped: {reason}" in finished.stderr
    for row in rows:
        assert row["check"]["ok"], row["check"]["detail"]  # same seed, data and steps: the same final model
        assert set(row["samples"]) == set(CONTENDERS) | (set(PEERS) - set(missing))
        assert all(value > 0 for samples in row["samples"].values() for value in samples)
        assert row["ratios"]["loopkit/raw"]["median"] > 0
    markdown = (tmp_path / "results.md").read_text()
    assert "| near-null model (16x16 linear) | us/step |" in markdown
    assert "Is loopkit ahead of every peer?" in markdown


def test_the_peers_end_with_the_hand_written_loops_weights_bit_for_bit(tmp_path):
    """pytorch-ignite, Lightning Fabric and Lightning's Trainer (benchmarks/contenders/peers.py) do the hand-written
    loop's work: over two epochs (the data order of each), with warmup, clipping and accumulation, their final weights
    are the raw loop's bit for bit, on the near-null model and on a tiny Llama (token-weighted accumulation)."""
    from benchmarks.suite.overhead import train_steps
    from benchmarks.workloads.spec import TrainSpec

    missing = missing_peers()
    if len(missing) == len(PEERS):
        pytest.skip("; ".join(f"{LABELS[peer]}: {reason}" for peer, reason in missing.items()))
    llama = dict(hidden_size=16, intermediate_size=32, vocab_size=64)
    for spec in (TrainSpec(model="null", num_train=64, logging_steps=3, max_steps=11, warmup_steps=3),
                 TrainSpec(model="llama-tiny", num_train=48, seq_len=16, logging_steps=2, max_steps=7, warmup_steps=2,
                           model_overrides=llama)):
        runs = {c: train_steps(c, spec.to_dict(), 2, str(tmp_path / c))
                for c in ("raw",) + tuple(peer for peer in PEERS if peer not in missing)}
        for contender, run in runs.items():
            assert run["global_step"] == spec.max_steps
            assert run["weights_sha256"] == runs["raw"]["weights_sha256"], (spec.model, contender)
            assert run["probe_loss"] == runs["raw"]["probe_loss"]


class InProcessWorker:
    """Stands in for a worker process: the same request, answered by calling the task here (JSON round trip
    included, so a task that returns something a pipe cannot carry still fails)."""

    def request(self, module: str, function: str, **kwargs) -> dict:
        reply = call({"module": module, "function": function, "kwargs": kwargs, "spawned_at": time.time()})
        return json.loads(json.dumps(reply))


class InProcessSuite(Suite):
    @contextmanager
    def workers(self, names=CONTENDERS, prefix=""):
        yield {name: InProcessWorker() for name in names}

    def fresh(self, name, module, function, **kwargs):
        return InProcessWorker().request(module, function, **kwargs)

    def fresh_many(self, jobs, parallel=2):
        return [self.fresh(name, module, function, **kwargs) for name, module, function, kwargs in jobs]


def test_every_other_benchmark_runs_tiny_with_equal_results_and_reports(tmp_path):
    import importlib

    suite = InProcessSuite(size="tiny", out_dir=tmp_path, threads=1)
    suite.environment = describe(threads=1)
    results = {"environment": {**suite.environment, "size": "tiny"}, "benchmarks": {}}
    try:
        for name in BENCHMARKS:
            if name == "overhead":
                continue  # the command test above runs it through real worker processes
            section = importlib.import_module(f"benchmarks.suite.{name}").run(suite)
            for row in section["rows"]:
                assert row["check"]["ok"], f"{name} / {row['name']}: {row['check']['detail']}"
            results["benchmarks"][name] = section
    finally:
        suite.cleanup()
    finetune = results["benchmarks"]["finetune"]["rows"][0]["extra"]["accuracy"]
    assert len(set(finetune.values())) == 1 and 0 <= finetune["loopkit"] <= 1
    for dataset, benchmark in (("reviews", "ladder"), ("debates", "ladder_debates"), ("hamlet", "ladder_hamlet")):
        assert results["benchmarks"][benchmark]["plan"]["dataset"] == dataset
        ladder = {name: runs[0] for name, runs in results["benchmarks"][benchmark]["runs"].items()}
        # every rung trained the same real tokens; the hand-written loop and loopkit's compiled packing trained the
        # same rows in the same order, so they end at the same loss
        assert len({run["real_tokens"] for run in ladder.values()}) == 1
        assert abs(ladder["raw"]["training_loss"] - ladder["loopkit-compile"]["training_loss"]) < 1e-4
        # per-text attention computes what the block mask does: the same rows train to the same loss
        assert abs(ladder["loopkit-per-text"]["training_loss"] - ladder["loopkit-chunked"]["training_loss"]) < 1e-4
        # every rung timed its whole second epoch: all of that epoch's steps, after the first epoch's
        for run in ladder.values():
            first, second = run["epoch_steps"]
            assert second == run["steps"] and 0 < first < second and run["measured_tokens"] < run["real_tokens"]
        # HF's flattening recipe: samples attend across the boundary unless use_cache=False
        assert ladder["hf-best"]["flattened_logits_error"] < 1e-5 < 1e-2 < ladder["hf-best-cache"][
            "flattened_logits_error"]
    # compile: the uncompiled run compiles nothing, every compiled one compiles, and a compiled AdamW step under a
    # schedule compiles at least once; every optimizer did the same steps (the row's check, above)
    compiled = results["benchmarks"]["compile"]
    assert [runs[0]["compilations"] > 0 for runs in compiled["runs"].values()] == [False, True, True, True]
    assert compiled["lr_recompiles"] >= 1
    assert {run["name"] for runs in results["benchmarks"]["chunked_loss"]["runs"].values() for run in runs} == {
        "unchunked", "chunked"}
    write_json(results, tmp_path / "results.json")
    charts = write_charts(results, tmp_path)
    markdown = write_markdown(results, tmp_path / "results.md", charts)
    for name in results["benchmarks"]:
        assert results["benchmarks"][name]["title"] in markdown
    assert json.loads((tmp_path / "results.json").read_text())["benchmarks"].keys() == results["benchmarks"].keys()


def test_a_contender_that_did_other_work_shows_mismatch_instead_of_a_number():
    from benchmarks.reports.verdicts import check_equal, comparison_row

    check = check_equal({"raw": 1.0, "hf": 1.0, "loopkit": 1.5}, 1e-5, "final probe loss")
    row = comparison_row("a row", "ms/step", {"raw": [2.0], "hf": [3.0], "loopkit": [1.234]}, check)
    table = comparison_table([row])
    assert not check["ok"] and check["mismatched"] == ["loopkit"]
    assert "MISMATCH" in table and "1.23" not in table
    assert "final probe loss differs" in table


def test_rows_whose_rounds_disagree_are_flagged_noisy_and_get_no_verdict():
    from benchmarks.reports.verdicts import comparison_row, loopkit_flags
    from benchmarks.reports.tables import noisy_rows, slow_rows

    steady = comparison_row("steady", "ms/step", {"raw": [10.0, 10.1, 9.9], "hf": [12.0, 12.2, 11.9],
                                                  "loopkit": [11.0, 11.1, 10.9]}, floor="raw")
    spread_out = comparison_row("spread out", "ms/step", {"raw": [10.0, 10.1, 9.9], "hf": [12.0, 12.2, 11.9],
                                                          "loopkit": [11.0, 14.0, 10.9]}, floor="raw")
    # the issue's quick tiny-Llama row: loopkit "faster" than the hand-written loop doing the same work
    below_floor = comparison_row("below the floor", "ms/step", {"raw": [45.0, 44.0, 46.0], "hf": [50.0, 49.0, 51.0],
                                                                "loopkit": [32.0, 33.0, 31.0]}, floor="raw")
    assert steady["noisy"] == [] and spread_out["noisy"] and below_floor["noisy"]
    # a wide spread is stated, and withholds no verdict (issue 34, item 11); a pair pointing both ways gets none
    assert spread_out["wide_spread"] == ["loopkit's rounds spread 28% (10.9-14.0 ms/step)"]
    assert spread_out["noisy"] == ["loopkit vs hf points both ways over the rounds (0.917x (0.92-1.15))"]
    assert "loopkit faster than raw, the physical limit (32.0 vs 45.0 ms/step" in below_floor["noisy"][0]
    # a steady 10% loss is reported with both absolute numbers beside the ratio; the noisy rows get no verdict
    assert loopkit_flags(steady) == ["10.0% slower than the raw loop (medians 11.0 vs 10.0 ms/step, 1.100x; "
                                     "rounds ranged 1.10-1.10x)"]
    assert [flag.split(" (")[0] for flag in loopkit_flags(spread_out)] == ["10.1% slower than the raw loop"]
    assert loopkit_flags(below_floor) == []
    results = {"benchmarks": {"b": {"title": "B", "rows": [steady, spread_out, below_floor]}}}
    assert [line.split(":")[0] for line in slow_rows(results)] == ["- B / steady", "- B / spread out"]
    assert [line.split(":")[0] for line in noisy_rows(results)] == ["- B / spread out", "- B / below the floor"]
    table = comparison_table([steady, spread_out, below_floor])
    assert table.count("NO, no verdict") == 2
    # without a floor (a contender may legitimately do less), being faster than raw is no noise
    no_floor = comparison_row("no floor", "s", {"raw": [1.0, 1.0], "loopkit": [0.5, 0.5]})
    assert no_floor["noisy"] == []


def test_results_go_to_an_untracked_folder_unless_out_says_otherwise(tmp_path):
    from benchmarks.__main__ import parse_args

    default = parse_args([]).out
    ignored = subprocess.run(["git", "check-ignore", "-q", str(default / "results.json")], cwd=REPO_ROOT)
    assert ignored.returncode == 0, f"{default} is not ignored by git"
    assert default != REPO_ROOT / "benchmarks" / "results"
    assert parse_args(["--out", str(tmp_path)]).out == tmp_path


def test_the_gpu_benchmark_fsdp2_variant_dry_runs_on_two_cpu_processes(tmp_path):
    """`python -m benchmarks.gpu --device cpu --tiny --fsdp 2`: the sharded variant's code path (torchrun, loopkit
    with Accelerate's FSDP2 plugin, the per-rank shard count) on gloo; on a GPU machine the same command without
    `--device cpu --tiny` measures it. Both ranks train the same model: the same logged losses."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    finished = run_process([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--tiny", "--fsdp", "2",
                            "--out", str(tmp_path)], "python -m benchmarks.gpu --device cpu --tiny --fsdp 2",
                           cwd=REPO_ROOT, env=env)
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    section = json.loads((tmp_path / "gpu-fsdp-cpu.json").read_text())
    ranks = section["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["is_fsdp2"] and r["distributed_type"] == "DistributedType.FSDP" for r in ranks)
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 3
    assert all(r["shard_bytes"]["optimizer"] > 0 and r["tokens_per_second"] > 0 for r in ranks)
    assert "| rank | ms/step |" in (tmp_path / "gpu-fsdp-cpu.md").read_text()


def test_the_gpu_benchmark_liger_variant_dry_runs_on_cpu(tmp_path):
    """`python -m benchmarks.gpu --device cpu --tiny --liger`: HF Trainer and loopkit, each with use_liger_kernel
    and without, in their own workers. On a CPU every Liger kernel is off (Triton needs a GPU), so no module runs
    Liger's forward and the four runs train the same model: the same probe loss. On a GPU machine the same command
    without `--device cpu --tiny` measures the kernels."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    finished = run_process([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--tiny", "--liger",
                            "--out", str(tmp_path)], "python -m benchmarks.gpu --device cpu --tiny --liger",
                           cwd=REPO_ROOT, env=env)
    assert finished.returncode == 0, (finished.stdout + finished.stderr)[-4000:]
    section = json.loads((tmp_path / "gpu-liger-cpu.json").read_text())
    runs = section["runs"]
    assert section["kernels_off"] and set(runs) == {"hf", "loopkit", "hf-plain", "loopkit-plain"}
    assert all(run["liger_modules"] == 0 and run["ms_per_step"] > 0 for run in runs.values())
    assert len({run["probe_loss"] for run in runs.values()}) == 1
    assert section["rows"][0]["check"]["ok"]
    assert "| run | ms/step (median) |" in (tmp_path / "gpu-liger-cpu.md").read_text()


def test_the_ladder_flags_a_rung_whose_held_out_loss_leaves_the_order_noise():
    from benchmarks.reports.ladder import loss_check

    def runs(*losses):
        return [{"heldout_loss": loss} for loss in losses]

    # the padded HF run moved 0.05 between two data orders: that is the noise a rung may differ by (floor 1%)
    check = loss_check({"hf-default": runs(6.00, 6.05), "loopkit-pack": runs(6.03, 6.01),
                        "hf-best-cache": runs(6.20, 6.25)})
    assert abs(check["tolerance"] - 0.06025) < 1e-12 and abs(check["noise"] - 0.05) < 1e-12
    assert check["mismatched"] == ["hf-best-cache"] and "hf-best-cache (+0.2)" in check["detail"]
    assert check["per_rung"]["loopkit-pack"]["agrees"]


def test_the_ladder_checks_length_grouping_against_hf_trainer_in_the_same_order():
    """Grouped batches make another objective (each step is its batch's token mean): loopkit's grouping rung is
    checked against HF Trainer's grouped run, whose own distance from the padded run is shown and not judged."""
    from benchmarks.reports.ladder import loss_check

    def runs(*losses):
        return [{"heldout_loss": loss} for loss in losses]

    check = loss_check({"hf-default": runs(6.00, 6.05), "hf-group": runs(6.30, 6.31),
                        "loopkit-group": runs(6.30, 6.32)})
    group, reference = check["per_rung"]["loopkit-group"], check["per_rung"]["hf-group"]
    assert group["against"] == "hf-group" and group["agrees"] and abs(group["difference"] - 0.01) < 1e-12
    assert reference["reference"] and not reference["agrees"] and check["ok"] and check["mismatched"] == []
    check = loss_check({"hf-default": runs(6.00, 6.05), "hf-group": runs(6.30, 6.31),
                        "loopkit-group": runs(6.50, 6.52)})
    assert check["mismatched"] == ["loopkit-group"]
    # a file without HF's grouped run (an older one): the padded run is the reference, as before
    assert loss_check({"hf-default": runs(6.0, 6.05), "loopkit-group": runs(6.3, 6.3)})["mismatched"] == [
        "loopkit-group"]


def test_loopkit_is_ahead_of_every_peer_only_where_every_round_against_every_peer_says_so():
    from benchmarks.suite.overhead import peers_verdict
    from benchmarks.reports.verdicts import check_equal, comparison_row

    def row(ignite, fabric, check=None):
        samples = {"raw": [10.0, 10.2], "hf": [30.0, 31.0], "loopkit": [11.0, 11.1], "ignite": ignite,
                   "fabric": fabric, "lightning": [40.0, 41.0]}
        return comparison_row("a row", "us/step", samples, check, floor="raw")

    assert peers_verdict(row([12.0, 12.5], [13.0, 12.0])).startswith("yes, faster than each in every round "
                                                                      "(loopkit / peer: pytorch-ignite 0.902x")
    # one round each way against Fabric: no verdict, so not ahead of every peer
    assert peers_verdict(row([12.0, 12.5], [10.5, 12.0])) == (
        "no: no verdict against Lightning Fabric: the rounds point both ways (0.986x (0.92-1.05))")
    assert peers_verdict(row([10.5, 10.6], [13.0, 12.0])).startswith("no: 4.7% slower than pytorch-ignite (medians")
    other_work = check_equal({"raw": 1.0, "hf": 1.0, "loopkit": 1.0, "ignite": 1.5, "fabric": 1.0, "lightning": 1.0},
                             1e-5, "final probe loss")
    assert peers_verdict(row([12.0, 12.5], [13.0, 12.0], other_work)) == (
        "no: no verdict against pytorch-ignite: not the same work")
    assert peers_verdict(comparison_row("no peers", "us/step", {"raw": [1.0], "loopkit": [1.1]})) == "no peer ran"


def interleaved_results(loopkit_runs, ignite_runs, losses=((1.0,), (1.0,))):
    """Two rounds of the overhead profile's interleaved method: raw at 400 us a run, two passes each."""
    def runs(values, logged=(1.0,)):
        return [{"cpu_us_per_step": v, "cpu_us_median_step": v, "logged_losses": list(logged)} for v in values]

    rounds = [{"raw": runs([400.0, 410.0]), "loopkit": runs(loopkit_runs[i], losses[i]), "ignite": runs(ignite_runs[i])}
              for i in range(2)]
    return {"timed_steps": 400, "interleaved": {"passes": 2, "peers_missing": {}, "rounds": rounds}}


def test_the_overhead_profiles_interleaved_verdicts_need_every_round():
    from benchmarks.reports.overhead_profile import interleaved_table

    table = interleaved_table(interleaved_results([[420.0, 440.0], [430.0, 450.0]], [[450.0, 460.0], [460.0, 470.0]]))
    # per round: the median over its passes of loopkit's run minus raw's (20, 30 -> 25; 30, 40 -> 35)
    assert "| loopkit | 435 (430-440) | +30.0 (+25.0 to +35.0) |  | yes |" in table
    assert "| ignite | 460 (455-465) | +55.0 (+50.0 to +60.0) | -25.0 (-25.0 to -25.0) | yes |" in table
    assert "- loopkit within 50 us of the hand-written loop in every round: yes" in table
    assert "- loopkit below ignite in every round: yes" in table
    # one round over the goal, one round where ignite is ahead, and a different logged loss: each is said
    table = interleaved_table(interleaved_results([[420.0, 440.0], [480.0, 470.0]], [[450.0, 460.0], [420.0, 430.0]],
                                                  losses=((1.0,), (1.5,))))
    assert "- loopkit within 50 us of the hand-written loop in every round: no (+47.5 (+25.0 to +70.0) us)" in table
    assert "- loopkit below ignite in every round: no" in table
    assert "| loopkit | 452 (430-475) | +47.5 (+25.0 to +70.0) |  | no |" in table


def test_the_overhead_profile_runs_every_contender_interleaved_in_one_process(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                         if p]))
    out = tmp_path / "profile"
    finished = run_process([sys.executable, "-m", "benchmarks.profiles.overhead", "--methods", "interleaved",
                            "--rounds", "1", "--passes", "1", "--steps", "60", "--warmup", "5", "--out", str(out)],
                           "python -m benchmarks.profiles.overhead --methods interleaved", cwd=REPO_ROOT, env=env)
    assert finished.returncode == 0, finished.stderr[-3000:]
    results = json.loads(out.with_suffix(".json").read_text())
    (reply,) = results["interleaved"]["rounds"]
    assert list(reply) == ["raw", "loopkit", "hf"] + [p for p in PEERS if p not in missing_peers()]
    logged = reply["raw"][0]["logged_losses"]
    assert len(logged) == 1  # a log at step 50: every contender trained the same steps on the same data
    # Lightning's Trainer (where installed) logs the loss of the step it logs at, not the mean since the last log
    assert all(runs[0]["logged_losses"] == logged for name, runs in reply.items() if name != "lightning")
    table = out.with_suffix(".md").read_text()
    assert "- loopkit within 50 us of the hand-written loop in every round: " in table
    assert "- loopkit below hf in every round: " in table


def test_the_ladder_profile_splits_a_tiny_rungs_step_into_op_groups(tmp_path):
    """`python -m benchmarks.profiles.ladder`'s worker at the ladder's tiny size (dynamo's eager backend): the timed
    epoch's op groups add up to the step, the matrix multiplies are found, and the bound is HF best's step over the
    least matrix-multiply time."""
    from benchmarks.profiles.ladder import GROUPS, OUTSIDE, bound, ladder_plan, markdown, profiled_rung

    plan = ladder_plan("reviews", "tiny")
    profiles = {name: profiled_rung(name, plan, str(tmp_path / name)) for name in ("hf-best", "loopkit-chunked")}
    for name, profile in profiles.items():
        groups = profile["groups_ms"]
        assert set(groups) == {g for g, _ in GROUPS} | {"other ops", OUTSIDE}, name
        assert profile["steps"] > 0 and groups["matrix multiplies"] > 0, name
        # the profiler covers the timed epoch only: its ops' own time fits in that epoch's steps (the warm-up
        # epoch's compilation and steps, profiled too, would not)
        assert sum(v for g, v in groups.items() if g != OUTSIDE) <= profile["step_ms"] * 1.05, name
    least = min(p["groups_ms"]["matrix multiplies"] for p in profiles.values())
    limit = bound(profiles)
    assert limit["at_most"] == pytest.approx(profiles["hf-best"]["step_ms"] / least)
    results = {"command": "python -m benchmarks.profiles.ladder", "cores": 2, "load_average": [1.0],
               "datasets": {"reviews": {"plan": plan, "profiles": profiles, "bound": limit}}}
    assert "| **step** |" in markdown(results) and "The bound: HF best's step" in markdown(results)
