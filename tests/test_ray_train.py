"""Ray Train runs `Loop` as it runs HF Trainer: `TorchTrainer` with 2 CPU workers (gloo), Ray's documented HF
integration (`prepare_trainer`, `RayTrainReportCallback`), a tiny Llama on real reviews (tests/scripts/ray_worker.py,
the function each worker runs). docs/distributed.md, "Ray Train", says what a user writes.

* One fit trains HF Trainer (DDP), then `Loop` under DDP with `HFStorage()` and `DCPStorage(async_save=True)`, and
  under FSDP2 (TrainingArguments' fsdp fields) with `DCPStorage()` and `DCPStorage(async_save=True)`. Every run
  makes 4 Ray reports (a save every 2 of 8 steps); each report's metrics name the step of the checkpoint it carries
  (its trainer_state.json) and the loss HF Trainer's report of that step carries, and the checkpoint holds that
  step's weights, `torch.equal` to Trainer's under DDP (asynchronous saves too) and under FSDP2 (sharded; Trainer on
  CPU processes does not shard: Accelerate keeps them MULTI_CPU), where only the logged gradient norm differs (summed
  from the shards), within 2e-4 relative. Final weights and every step's loss likewise.
* Ray's fault tolerance, in the same fit: two more runs, `Loop` under DDP with `HFStorage()` and with
  `DCPStorage(async_save=True)`, each losing worker 1 to a SIGKILL at the end of its step 7 once
  (`FailureConfig(max_failures=2)`); Ray restarts both workers, the script skips the runs already finished and
  resumes the interrupted one from `ray.train.get_checkpoint()` (Ray's copy) with `resume_from_checkpoint`, and the
  run ends with its uninterrupted twin's weights (`torch.equal`) and losses at every step after the resume. One fit
  for all: each fit and each attempt starts Ray's processes anew (the module's time).

Ray is a test extra only (setup.cfg's `test` and `ray` extras); without it these tests skip.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading

import pytest
import torch
from safetensors.torch import load_file

from helpers import PROCESS_WAIT_S

pytest.importorskip("ray.train", reason="Ray Train (the `ray` extra)")

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(TESTS, "scripts"))
import ray_worker  # noqa: E402

REPORTS = [2, 4, 6, 8]  # the saved steps: one Ray report each
KILL_STEP = 7
# FSDP2's gradient norm is summed from the shards, DDP's from whole gradients (measured: 7.4e-6, 3.3e-5 and 8.1e-5
# relative apart at steps 2, 4 and 8); no step is clipped at these norms (below 1), so losses and weights are the same
FSDP2_NORM_RTOL = 2e-4
RUNS = {  # name: (runner, storage, fsdp, killed)
    "trainer": ("hf", "-", False, False),
    "ddp": ("loop", "hf", False, False),
    "ddp-dcp-async": ("loop", "dcp-async", False, False),
    "fsdp2-dcp": ("loop", "dcp", True, False),
    "fsdp2-dcp-async": ("loop", "dcp-async", True, False),
    # each run killed once (the retries: attempts 1 and 2), and the uninterrupted run it must end as
    "ddp-killed": ("loop", "hf", False, True),
    "ddp-dcp-async-killed": ("loop", "dcp-async", False, True),
}
KILLED = {"ddp-killed": "ddp", "ddp-dcp-async-killed": "ddp-dcp-async"}


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance for the module: 2 CPUs, no dashboard, a small object store, its files in a temporary
    folder; the workers find loopkit and the test scripts on their PYTHONPATH."""
    import ray

    folder = tempfile.TemporaryDirectory(prefix="ray-")
    paths = [os.path.dirname(TESTS), TESTS, os.path.join(TESTS, "scripts")]
    env = {"PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20,
             runtime_env={"env_vars": env}, _temp_dir=os.path.join(folder.name, "session"))
    yield folder.name
    ray.shutdown()
    folder.cleanup()


def fit(root: str, runs: dict):
    """`TorchTrainer(...).fit()` of `runs` (name: (runner, storage, fsdp, killed)) on 2 CPU workers, storage in
    `root`; Ray may retry once per killed run. Returns Ray's result and the results folder. Bounded: a fit still
    running after PROCESS_WAIT_S fails the test."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    results = os.path.join(root, "results")
    os.makedirs(results)
    config = {"results": results, "kill_step": KILL_STEP,
              "runs": [{"name": name, "runner": runner, "storage": storage, "fsdp": fsdp, "kill": killed,
                        "output_dir": os.path.join(root, name)}
                       for name, (runner, storage, fsdp, killed) in runs.items()]}
    retries = sum(killed for *_, killed in runs.values())
    trainer = TorchTrainer(ray_worker.train_func, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=os.path.join(root, "ray"), name="run",
                                                failure_config=FailureConfig(max_failures=retries)))
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(result=trainer.fit()), daemon=True)
    thread.start()
    thread.join(PROCESS_WAIT_S)
    if thread.is_alive():
        pytest.fail(f"TorchTrainer.fit() of {list(runs)} was still running after {PROCESS_WAIT_S} s")
    assert "result" in outcome, "TorchTrainer.fit() raised (its error is printed above)"
    return outcome["result"], results


def reported(result) -> list[dict]:
    """Ray's reports, in order: the metrics, and what the checkpoint it carries holds (its step, its weights)."""
    from loopkit.storage.dcp import read_whole_state

    reports = []
    for checkpoint, metrics in result.best_checkpoints:
        folder = os.path.join(checkpoint.path, "checkpoint")
        with open(os.path.join(folder, "trainer_state.json")) as f:
            step = json.load(f)["global_step"]
        weights_file = os.path.join(folder, "model.safetensors")
        weights = load_file(weights_file) if os.path.exists(weights_file) else read_whole_state(folder)["model"]
        reports.append({"metrics": metrics, "step": step, "weights": weights})
    return reports


def losses(log_history: list[dict], after: int = 0) -> dict:
    return {entry["step"]: entry["loss"] for entry in log_history if "loss" in entry and entry["step"] > after}


def run_results(results: str, name: str, attempt: int = 0) -> tuple[dict, dict]:
    """A run's final weights (rank 0) and rank 0's record (log history, the step it resumed from)."""
    prefix = os.path.join(results, f"{name}-attempt{attempt}")
    with open(f"{prefix}-rank0.json") as f:
        return load_file(f"{prefix}.safetensors"), json.load(f)


def assert_equal_weights(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), f"{what}: {key} differs"


@pytest.fixture(scope="module")
def ray_runs(ray_session):
    """One fit of every run of RUNS, one after the other in the same 2 workers (each report goes to the same Ray
    run: RUNS' order, 4 reports each, a killed run's retry included)."""
    root = os.path.join(ray_session, "runs")
    result, results = fit(root, RUNS)
    reports = reported(result)
    assert len(reports) == len(REPORTS) * len(RUNS), [r["step"] for r in reports]
    by_run = {name: reports[i * len(REPORTS):(i + 1) * len(REPORTS)] for i, name in enumerate(RUNS)}
    return by_run, results


@pytest.mark.parametrize("name", [name for name in RUNS if name != "trainer" and name not in KILLED])
def test_each_ray_report_carries_its_own_steps_checkpoint_as_under_trainer(ray_runs, name):
    by_run, results = ray_runs
    norm_rtol = FSDP2_NORM_RTOL if RUNS[name][2] else 0
    trainer_final, trainer_record = run_results(results, "trainer")
    final, record = run_results(results, name)
    for report, trainer_report in zip(by_run[name], by_run["trainer"], strict=True):
        metrics, expected = report["metrics"], trainer_report["metrics"]
        # the metrics of a report are those of its checkpoint's step, as Trainer's are
        assert report["step"] == metrics["step"] == trainer_report["step"] == expected["step"]
        assert metrics["loss"] == expected["loss"] and metrics["learning_rate"] == expected["learning_rate"]
        assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=norm_rtol, abs=0)
        assert_equal_weights(report["weights"], trainer_report["weights"], f"{name}'s report of step {report['step']}")
    assert [r["step"] for r in by_run[name]] == REPORTS
    assert_equal_weights(final, trainer_final, f"{name}'s final weights")
    assert losses(record["log_history"]) == losses(trainer_record["log_history"])
    assert list(losses(record["log_history"])) == list(range(1, 9))


def test_fsdp2_under_ray_shards_the_checkpoints(ray_runs):
    """The FSDP2 runs really shard: each rank wrote its own DCP file of the checkpoint Ray copied."""
    results = ray_runs[1]
    for name in ("fsdp2-dcp", "fsdp2-dcp-async"):
        dcp = os.path.join(os.path.dirname(results), name, "checkpoint-8", "dcp")
        assert sorted(f for f in os.listdir(dcp) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("name", list(KILLED))
def test_a_worker_killed_mid_run_resumes_from_rays_latest_checkpoint_exactly(ray_runs, name):
    """Worker 1 dies at the end of step 7; Ray restarts both workers and the script resumes from Ray's latest
    checkpoint: step 6's with synchronous saves, and with asynchronous ones on 2 processes step 4's (a checkpoint is
    reported at the next save, once every process has seen it committed), or an earlier one if Ray's controller had
    not collected the last report when the worker died. The retry ends as the uninterrupted run."""
    by_run, results = ray_runs
    attempt = list(KILLED).index(name) + 1  # the kills come in RUNS' order, one attempt each
    assert open(os.path.join(results, f"killed-{name}")).read() == str(KILL_STEP)
    # this run's attempt before the kill left no record (it died); the unkilled runs trained once, in attempt 0
    assert sorted(f for f in os.listdir(results) if f.startswith(f"{name}-attempt")) == \
        [f"{name}-attempt{attempt}-rank0.json", f"{name}-attempt{attempt}-rank1.json",
         f"{name}-attempt{attempt}.safetensors"]
    assert all(os.path.exists(os.path.join(results, f"{other}-attempt0-rank1.json"))
               for other in RUNS if other not in KILLED)
    final, record = run_results(results, name, attempt=attempt)
    resumed_step = record["resumed_step"]
    assert resumed_step in REPORTS[:3 if RUNS[name][1] == "hf" else 2], resumed_step
    # Ray's reports: the killed attempt's up to the resume step, then the retry's; no step twice, none missing, so
    # the checkpoint resumed was the newest Ray held
    assert [r["step"] for r in by_run[name]] == REPORTS
    uninterrupted_final, uninterrupted = run_results(results, KILLED[name])
    assert_equal_weights(final, uninterrupted_final, "the resumed run's final weights")
    after = losses(record["log_history"], after=resumed_step)
    assert list(after) == list(range(resumed_step + 1, 9))
    assert after == losses(uninterrupted["log_history"], after=resumed_step)
