"""`push_to_hub=True` as with `transformers.Trainer`: the same Hub calls at the same moments, the same files uploaded,
nothing blocking training, no upload racing rotation or an asynchronous save, no secret written anywhere.

Offline: a recording fake of transformers' shared `HfApi` stands in for the Hub in both runners, patched where each
looks it up (`transformers.trainer.hf_api` for Trainer, `loopkit.trainer.hub.hf_api` for `Loop`; loopkit's reachability
probe is told the Hub answers). Like `HfApi`, the fake runs `run_as_future=True` uploads one at a time on its own
thread and lists the folder when the upload runs (through `huggingface_hub`'s own pattern filter); a gated fake
holds every upload until the test opens the gate, to show what waits for an upload and what does not.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from huggingface_hub.utils import filter_repo_objects
from transformers import Trainer, TrainerCallback

import loopkit.trainer.hub
from loopkit import EvalStage, Loop, LoopArgs
from tests.helpers import IGNORE_PIN_MEMORY_WARNING, PROCESS_WAIT_S, Recorder, hf_args, lm_data, runners, tiny_llama

pytestmark = IGNORE_PIN_MEMORY_WARNING

SECRET = "hf_loopkitTestTokenNeverWritten"
# Written by one runner only, on purpose (docs/differences.md): loopkit's stage state and run report. (Trainer's
# `training_args.bin` both write, for a TrainingArguments.)
HF_ONLY: set = set()
LOOPKIT_ONLY = {"loopkit_state.json", "loopkit_tensors.safetensors", "run_report.json", "run_report.md", "loss.png",
                "learning_rate.png", "throughput.png", "eval_metrics.png"}
# An upload still held after this long means training waited for it: the test fails (generous: a busy machine)
GATE_TIMEOUT_S = PROCESS_WAIT_S


class FakeHub:
    """Records `create_repo` and `upload_folder` calls. Gated, the `run_as_future` uploads run on one background
    thread, as `HfApi`'s, each held until the gate opens; ungated, they are done when the call returns."""

    def __init__(self, root: str, gated: bool = False):
        self.root, self.calls, self.lock = root, [], threading.Lock()
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.executor = ThreadPoolExecutor(max_workers=1)

    def create_repo(self, repo_id, token=None, private=None, exist_ok=False, **kwargs):
        self.calls.append(dict(call="create_repo", repo_id=repo_id, token=token, private=private, exist_ok=exist_ok,
                               **kwargs))
        return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"user/{repo_id}")

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, commit_message=None, token=None,
                      run_as_future=False, ignore_patterns=None, allow_patterns=None, revision=None, **kwargs):
        record = dict(call="upload_folder", repo_id=repo_id, folder=os.path.relpath(folder_path, self.root),
                      path_in_repo=path_in_repo, commit_message=commit_message, token=token,
                      run_as_future=run_as_future, revision=revision, allow_patterns=allow_patterns, **kwargs)
        record["ignore_patterns"] = ignore_patterns
        self.calls.append(record)
        if not run_as_future:
            return self.upload(record, folder_path, allow_patterns, ignore_patterns)
        if self.gate.is_set():  # done at once, so whether a later save pushes never depends on timing
            done = Future()
            try:
                done.set_result(self.upload(record, folder_path, allow_patterns, ignore_patterns))
            except Exception as exc:  # in the future, as HfApi's
                done.set_exception(exc)
            return done
        return self.executor.submit(self.upload, record, folder_path, allow_patterns, ignore_patterns)

    def upload(self, record, folder_path, allow_patterns, ignore_patterns):
        """What HfApi does in the upload: list the folder, filter, read every file (here: its bytes' length)."""
        record["held_too_long"] = not self.gate.wait(GATE_TIMEOUT_S)
        try:
            if not os.path.isdir(folder_path):  # HfApi's own check
                raise FileNotFoundError(f"Provided path: '{folder_path}' is not a directory")
            listed = sorted(os.path.relpath(os.path.join(top, name), folder_path)
                            for top, _, names in os.walk(folder_path) for name in names)
            files = list(filter_repo_objects(listed, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
            for name in files:
                with open(os.path.join(folder_path, name), "rb") as f:
                    f.read()
            record["files"] = files
        except OSError as exc:  # a folder or file deleted under the upload
            record["failed"] = f"{type(exc).__name__}: {exc}"
            raise
        return f"commit of {record['folder']}"

    def patch(self, monkeypatch):
        monkeypatch.setattr("transformers.trainer.hf_api", lambda: self)
        monkeypatch.setattr(loopkit.trainer.hub, "hf_api", lambda: self)
        monkeypatch.setattr(loopkit.trainer.hub, "hub_unreachable_reason", lambda endpoint, timeout=None: None)

    def uploads(self):
        return [c for c in self.calls if c["call"] == "upload_folder"]


class OpenGateAt(TrainerCallback):
    """Opens the fake's gate at `event`: every upload until then is held, and training must not wait for it."""

    def __init__(self, hub: FakeHub, event: str):
        self.hub = hub
        setattr(self, event, lambda *args, **kwargs: self.hub.gate.set())


def tokenizer():
    from tests.helpers import minilm_tokenizer

    return minilm_tokenizer()


def train_with_hub(runner, output_dir, monkeypatch, gated=False, open_at="on_train_end", evaluation=None,
                   callbacks=(), **arg_kwargs):
    """One run of `runner` with push_to_hub=True against a fresh fake; returns (fake, recorder, trainer)."""
    hub = FakeHub(str(output_dir), gated=gated)
    hub.patch(monkeypatch)
    recorder = Recorder()
    callbacks = [recorder] + ([OpenGateAt(hub, open_at)] if gated else []) + list(callbacks)
    fields = dict(max_steps=6, save_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, push_to_hub=True,
                  hub_token=SECRET, hub_model_id="me/tiny", hub_private_repo=True, hub_revision="dev")
    fields.update(arg_kwargs)
    extra = {} if evaluation is None else dict(evaluation=evaluation)
    trainer = runner(model=tiny_llama(), args=hf_args(output_dir, **fields), train_dataset=lm_data(24),
                     processing_class=tokenizer(), callbacks=callbacks, **extra)
    trainer.train()
    hub.executor.shutdown(wait=True)
    return hub, recorder, trainer


def comparable(call: dict) -> dict:
    """A call without what legitimately differs: the ignore patterns (compared apart) and the upload's timing."""
    return {k: v for k, v in call.items() if k not in ("ignore_patterns", "files", "held_too_long")}


def assert_same_uploads(hf_calls, lk_calls):
    assert [comparable(c) for c in lk_calls] == [comparable(c) for c in hf_calls]
    for hf_call, lk_call in zip(hf_calls, lk_calls):
        if hf_call.get("ignore_patterns") is not None:  # loopkit also leaves out its .tmp-/.old-/.deleting- folders
            assert set(hf_call["ignore_patterns"]) <= set(lk_call["ignore_patterns"])
        hf_files = set(hf_call.get("files", [])) - HF_ONLY
        lk_files = set(lk_call.get("files", [])) - LOOPKIT_ONLY
        assert lk_files == hf_files, f"{lk_call['commit_message']}: {sorted(lk_files ^ hf_files)}"
        assert "failed" not in lk_call


# ---------------------------------------------------------------------------------------------------------------
# The same calls, files and events as Trainer, for each strategy
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints", "end"])
def test_pushes_at_saves_as_trainer(tmp_path, monkeypatch, strategy):
    results = {}
    for name, runner in runners():
        hub, recorder, trainer = train_with_hub(runner, tmp_path / name, monkeypatch, hub_strategy=strategy,
                                                save_total_limit=2)
        results[name] = dict(calls=hub.calls, events=recorder.events, repo=trainer.hub_model_id)
    hf, lk = results["hf"], results["loopkit"]
    assert hf["calls"][0] == dict(call="create_repo", repo_id="me/tiny", token=SECRET, private=True, exist_ok=True)
    assert lk["calls"][0] == hf["calls"][0] and lk["repo"] == hf["repo"] == "me/tiny"
    uploads = [c for c in hf["calls"] if c["call"] == "upload_folder"]
    per_save = {"every_save": 1, "checkpoint": 2, "all_checkpoints": 2, "end": 0}[strategy]
    assert len(uploads) == 3 * per_save  # saves at steps 2, 4 and 6
    if strategy != "end":
        assert uploads[0]["commit_message"] == "Training in progress, step 2" and uploads[0]["revision"] == "dev"
        assert "model.safetensors" in uploads[0]["files"] and "tokenizer.json" in uploads[0]["files"]
    if strategy in ("checkpoint", "all_checkpoints"):
        assert uploads[1]["path_in_repo"] == ("last-checkpoint" if strategy == "checkpoint" else "checkpoint-2")
        assert "optimizer.pt" in uploads[1]["files"]
    assert_same_uploads(hf["calls"][1:], lk["calls"][1:])
    # on_push_begin fires at the same moments (before on_save), and every other event is unchanged.
    assert lk["events"] == hf["events"]
    assert sum(e[0] == "on_push_begin" for e in hf["events"]) == (3 if per_save else 0)


def test_save_model_and_push_to_hub_after_training_as_trainer(tmp_path, monkeypatch):
    """hub_strategy="end": nothing at saves; a user's save_model() pushes ("Model save"), and push_to_hub() pushes
    output_dir with its model card, as Trainer."""
    results = {}
    for name, runner in runners():
        hub, recorder, trainer = train_with_hub(runner, tmp_path / name, monkeypatch, hub_strategy="end")
        trainer.save_model()
        commit = trainer.push_to_hub(commit_message="End of training", blocking=False).result()
        results[name] = dict(calls=hub.calls, events=[e[0] for e in recorder.events], commit=commit)
    hf, lk = results["hf"], results["loopkit"]
    uploads = [c for c in hf["calls"] if c["call"] == "upload_folder"]
    assert [(c["commit_message"], c["run_as_future"]) for c in uploads] == [("Model save", False),
                                                                            ("End of training", True)]
    assert "README.md" in uploads[1]["files"] and not any(f.startswith("checkpoint-") for f in uploads[1]["files"])
    assert_same_uploads(hf["calls"][1:], lk["calls"][1:])
    assert lk["events"][-2:] == hf["events"][-2:] == ["on_push_begin", "on_push_begin"]
    assert lk["commit"] == hf["commit"]


# ---------------------------------------------------------------------------------------------------------------
# Nothing waits for an upload, and no upload races rotation or an asynchronous save
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("always_push", [False, True])
def test_a_slow_push_never_blocks_training(tmp_path, monkeypatch, always_push):
    """Every upload is held until on_train_end: a run that waited for one would hold past the gate's timeout. With
    the first push in flight, later saves push nothing unless hub_always_push, as in Trainer; train() returns only
    when every upload is done."""
    results = {}
    for name, runner in runners():
        hub, recorder, trainer = train_with_hub(runner, tmp_path / name, monkeypatch, gated=True,
                                                hub_strategy="all_checkpoints", hub_always_push=always_push)
        uploads = hub.uploads()
        assert not any(c["held_too_long"] for c in uploads), f"{name}: training waited for an upload"
        assert all("files" in c for c in uploads), f"{name}: train() returned before an upload ended"
        results[name] = [comparable(c) for c in uploads]
    assert results["loopkit"] == results["hf"]
    assert len(results["hf"]) == (6 if always_push else 2)  # 3 saves x 2 uploads, or the first save's only


def test_rotation_never_deletes_a_folder_being_uploaded(tmp_path, monkeypatch):
    """save_total_limit=1 with every checkpoint pushed: Trainer's rotation deletes checkpoint-2 while its upload is
    still held, and that upload then fails; loopkit's leaves it until the upload is done, then deletes it."""
    found = {}
    for name, runner in runners():
        hub, _, trainer = train_with_hub(runner, tmp_path / name, monkeypatch, gated=True,
                                         hub_strategy="all_checkpoints", hub_always_push=True, save_total_limit=1)
        found[name] = (hub.uploads(), sorted(p for p in os.listdir(tmp_path / name) if p.startswith("checkpoint")))
    hf_uploads, hf_left = found["hf"]
    lk_uploads, lk_left = found["loopkit"]
    assert [c["folder"] for c in hf_uploads if "failed" in c] == ["checkpoint-2", "checkpoint-4"]  # Trainer's race
    assert [c["folder"] for c in lk_uploads if "failed" in c] == []
    assert [c["folder"] for c in lk_uploads if c["path_in_repo"]] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert all("optimizer.pt" in c["files"] for c in lk_uploads if c["path_in_repo"])
    assert lk_left == hf_left == ["checkpoint-6"]  # the deferred deletions happened once the uploads were done


def test_async_save_uploads_only_complete_folders(tmp_path, monkeypatch):
    """With async_save the writer thread queues the uploads after the rename: each checkpoint upload lists the
    whole folder, loopkit_state.json (written last) included, and its commit names its own step. Held uploads
    (hub_always_push) keep neither the writer nor training waiting."""
    hub, recorder, _ = train_with_hub(Loop, tmp_path, monkeypatch, evaluation=EvalStage(async_save=True),
                                      gated=True, hub_strategy="checkpoint", hub_always_push=True)
    assert not any(c["held_too_long"] for c in hub.uploads())
    checkpoint_uploads = [c for c in hub.uploads() if c["path_in_repo"] == "last-checkpoint"]
    assert [c["commit_message"] for c in checkpoint_uploads] == [f"Training in progress, step {s}, checkpoint"
                                                                 for s in (2, 4, 6)]
    for upload in checkpoint_uploads:
        assert {"loopkit_state.json", "trainer_state.json", "model.safetensors", "optimizer.pt"} <= \
            set(upload["files"])
    assert [e[0] for e in recorder.events].count("on_push_begin") == 3
    assert not any(name.startswith((".tmp-", "_loopkit-")) for name in os.listdir(tmp_path))


def test_hub_progress_bars_are_off_while_training_as_in_trainer(tmp_path, monkeypatch):
    """Background uploads print no progress bars into the training output; they are back after train()."""
    from huggingface_hub.utils import are_progress_bars_disabled

    seen = {}
    for name, runner in runners():
        during = []
        probe = type("Probe", (TrainerCallback,), {
            "on_step_end": lambda self, *args, **kwargs: during.append(are_progress_bars_disabled())})()
        train_with_hub(runner, tmp_path / name, monkeypatch, hub_strategy="every_save", callbacks=[probe])
        seen[name] = (during, are_progress_bars_disabled())
    assert seen["loopkit"] == seen["hf"] == ([True] * 6, False)


# ---------------------------------------------------------------------------------------------------------------
# Secrets, arguments, failures
# ---------------------------------------------------------------------------------------------------------------
def test_the_token_is_written_nowhere(tmp_path, monkeypatch, capsys, caplog):
    caplog.set_level("DEBUG")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        hub, _, trainer = train_with_hub(Loop, tmp_path, monkeypatch, hub_strategy="checkpoint")
        trainer.push_to_hub()
    assert not any(SECRET in str(w.message) for w in warned)
    assert all(c["token"] == SECRET for c in hub.calls)  # it reaches the Hub calls...
    assert (tmp_path / "training_args.bin").is_file()  # written as Trainer writes it, less the token (Trainer's has it)
    for top, _, names in os.walk(tmp_path):  # ...and no file: checkpoints, trainer_state, run report, model card
        for name in names:
            with open(os.path.join(top, name), "rb") as f:
                assert SECRET.encode() not in f.read(), os.path.join(top, name)
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err + caplog.text
    assert SECRET not in repr(LoopArgs(push_to_hub=True, hub_token=SECRET))
    assert SECRET not in LoopArgs(hub_token=SECRET).to_json_string()
    assert SECRET not in repr(trainer)


def test_loop_args_take_the_hub_fields(tmp_path, monkeypatch):
    """LoopArgs has Trainer's Hub fields and defaults; a strategy name that is none of Trainer's is refused."""
    from transformers import TrainingArguments

    reference = TrainingArguments(output_dir=str(tmp_path))
    for name in ("push_to_hub", "hub_token", "hub_private_repo", "hub_model_id", "hub_always_push", "hub_revision"):
        assert getattr(LoopArgs(), name) == getattr(reference, name)
    assert LoopArgs().hub_strategy == reference.hub_strategy.value
    from loopkit.args import LoopConfigError

    hub = FakeHub(str(tmp_path))
    hub.patch(monkeypatch)
    with pytest.raises(LoopConfigError, match="hub_strategy='every_step'"):
        Loop(model=tiny_llama(), args=LoopArgs(str(tmp_path), push_to_hub=True, hub_strategy="every_step"),
             train_dataset=lm_data(8))
    assert hub.calls == []


def test_a_failed_push_warns_and_training_goes_on(tmp_path, monkeypatch):
    """An upload that fails (its future holds the error) is named in a warning; the run completes and the
    checkpoints stay."""
    def failing_upload(record, folder_path, allow_patterns, ignore_patterns):
        raise ConnectionError("the Hub went away")

    hub = FakeHub(str(tmp_path))
    monkeypatch.setattr(hub, "upload", failing_upload)
    hub.patch(monkeypatch)
    loop = Loop(model=tiny_llama(), args=hf_args(tmp_path, max_steps=4, save_steps=2, push_to_hub=True,
                                                 per_device_train_batch_size=4),
                train_dataset=lm_data(16))
    with pytest.warns(UserWarning) as warned:
        output = loop.train()
    failures = [str(w.message) for w in warned if "to the Hub repo" in str(w.message)]
    assert len(failures) == 2  # the pushes at steps 2 and 4 (each found done at the next push or at the end)
    assert all(re.search(r"^Pushing .*\(Training in progress, step \d\) to the Hub repo user/\S+ failed "
                         r"\(ConnectionError: the Hub went away\)\. Nothing else is affected", m) for m in failures)
    assert output.global_step == 4
    assert hub.calls[0]["repo_id"] == tmp_path.name  # no hub_model_id: the output folder's name, as Trainer
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("checkpoint")) == ["checkpoint-2", "checkpoint-4"]


def test_an_unreachable_hub_is_refused_when_the_loop_is_built(tmp_path, monkeypatch):
    """As Trainer, the repo is created when the Loop is built: offline, that fails at once, naming why."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConnectionError, match="init_hf_repo: .*HF_HUB_OFFLINE.*Fix: .*push_to_hub=False"):
        Loop(model=tiny_llama(), args=hf_args(tmp_path, push_to_hub=True), train_dataset=lm_data(8))


def test_trainer_is_patched_where_it_looks_up_the_hub():
    """The fake only proves something if Trainer really pushes through `transformers.trainer.hf_api`."""
    import inspect

    source = inspect.getsource(Trainer._push_from_checkpoint) + inspect.getsource(Trainer.init_hf_repo)
    assert source.count("hf_api()") == 3
