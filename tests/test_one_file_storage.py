"""A checkpoint storage that writes each checkpoint as ONE file, the one docs/checkpoints.md ("Writing another
storage") shows, taken from the page itself: it saves, survives a SIGKILL in the middle of its write and in
training, resumes bit-identically, rotates (`save_total_limit`, the best kept), loads the best model (`load_best_model_at_end`), and the run's readers
(`python -m loopkit report`, the interruption report's newest checkpoint) read its folders. The earlier protocol's
method names are refused with the new ones named.

Run as a script, this file is the training child: `python test_one_file_storage.py OUT [kill-save N | kill-step N]`.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch



def storage_from_the_docs() -> type:
    """The one-file storage of docs/checkpoints.md ("Writing another storage"), taken from the page as it stands."""
    page = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "checkpoints.md")).read()
    start = page.index("```py\n", page.index("A format that writes one file")) + len("```py\n")
    namespace: dict = {}
    exec(compile(page[start:page.index("```", start)], "docs/checkpoints.md", "exec"), namespace)
    return namespace["OneFileStorage"]


OneFileStorage = storage_from_the_docs()  # checkpoint-<step>/checkpoint.pt: everything in one torch.save
FILE = "checkpoint.pt"


# -------------------------------------------------------------------------------------------------------------
# The training child
# -------------------------------------------------------------------------------------------------------------
MAX_STEPS, SAVE_STEPS, LIMIT = 12, 2, 2


class KillingStorage(OneFileStorage):
    """Dies (SIGKILL) at its `kill_at`-th write, with the file half written."""

    def __init__(self, kill_at=None, **options):
        super().__init__(**options)
        self.kill_at, self.writes = kill_at, 0

    def write_checkpoint(self, checkpoint, folder):
        super().write_checkpoint(checkpoint, folder)
        self.writes += 1
        if self.writes == self.kill_at:
            path = os.path.join(folder, FILE)
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
            os.kill(os.getpid(), signal.SIGKILL)


def make_loop(out, storage, callbacks=()):
    from transformers import LlamaConfig, LlamaForCausalLM

    from loopkit import Loop, LoopArgs

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(40)]
    for sample in data:
        sample["labels"] = sample["input_ids"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.1,
                                         max_position_embeddings=32))
    # greater_is_better on the loss: the best checkpoint is the first one, which rotation must keep to the end
    args = LoopArgs(output_dir=out, max_steps=MAX_STEPS, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    learning_rate=3e-3, warmup_steps=3, logging_steps=1, save_steps=SAVE_STEPS, save_total_limit=LIMIT,
                    eval_strategy="steps", eval_steps=SAVE_STEPS, per_device_eval_batch_size=2,
                    load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True,
                    disable_tqdm=True, report_to="none", seed=11)
    return Loop(model=model, args=args, train_dataset=data, eval_dataset=data[:6], storage=storage,
                callbacks=list(callbacks))


def child(out, how=None, at=None):
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    from loopkit.checkpoint import last_checkpoint

    class Watch(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            if how == "kill-step" and state.global_step == at:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == MAX_STEPS:  # the trained weights, before the best checkpoint is loaded
                save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
                          os.path.join(out, "last_step.safetensors"))

    storage = KillingStorage(kill_at=at if how == "kill-save" else None)
    loop = make_loop(out, storage, [Watch()])
    loop.train(resume_from_checkpoint=True if last_checkpoint(out, storage) else None)
    save_file({k: v.contiguous() for k, v in loop.model.state_dict().items()}, os.path.join(out, "final.safetensors"))
    with open(os.path.join(out, "best.json"), "w") as f:
        json.dump({"best": loop.state.best_model_checkpoint}, f)


# -------------------------------------------------------------------------------------------------------------
# The tests
# -------------------------------------------------------------------------------------------------------------
def run_child(forked, out, *how):
    return forked.run([sys.executable, os.path.abspath(__file__), str(out), *map(str, how)],
                      f"test_one_file_storage.py {' '.join(map(str, how))}")


def weights(out, name):
    from safetensors.torch import load_file

    return load_file(os.path.join(out, name))


def assert_same(a, b, what):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs from the uninterrupted run"


@pytest.fixture(scope="module")
def reference(tmp_path_factory, forked):
    out = str(tmp_path_factory.mktemp("reference"))
    result = run_child(forked, out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_each_checkpoint_is_one_file_rotated_with_the_best_kept_and_loaded(reference):
    from loopkit.checkpoint import checkpoint_dirs

    folders = checkpoint_dirs(reference)
    assert [os.listdir(path) for path in folders] == [[FILE]] * len(folders)
    # save_total_limit=2 keeps the newest and the best (the first save, by greater_is_better on the loss)
    assert [os.path.basename(path) for path in folders] == [f"checkpoint-{SAVE_STEPS}", f"checkpoint-{MAX_STEPS}"]
    best = json.load(open(os.path.join(reference, "best.json")))["best"]
    assert os.path.basename(best) == f"checkpoint-{SAVE_STEPS}"
    saved_best = OneFileStorage().whole(best)["model"]
    final = weights(reference, "final.safetensors")
    assert all(torch.equal(final[name], saved_best[name]) for name in final), "the best model was not loaded"
    assert not all(torch.equal(final[name], tensor) for name, tensor in weights(reference, "last_step.safetensors")
                   .items()), "the best checkpoint holds the last step's weights: the test would not see a load"


def test_sigkill_in_a_save_and_in_training_then_resume_bit_identically(tmp_path, reference, forked):
    out = str(tmp_path / "run")
    storage = OneFileStorage()
    result = run_child(forked, out, "kill-save", 3)  # the third save (step 6), its file half written
    assert result.returncode == -9, result.stderr[-2000:]
    assert os.path.isdir(os.path.join(out, f".tmp-checkpoint-{3 * SAVE_STEPS}")), os.listdir(out)
    from loopkit.checkpoint import checkpoint_dirs, last_checkpoint

    for path in checkpoint_dirs(out):
        assert storage.checkpoint_problem(path) is None, f"{path} is broken after a kill in a save"
    assert os.path.basename(last_checkpoint(out, storage)) == f"checkpoint-{2 * SAVE_STEPS}"
    result = run_child(forked, out, "kill-step", 9)  # resumed from step 4; killed inside step 10's window
    assert result.returncode == -9, result.stderr[-2000:]
    assert os.path.basename(last_checkpoint(out, storage)) == "checkpoint-8"
    result = run_child(forked, out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p for p in os.listdir(out) if p.startswith(".")] == [], "a killed save's folder was left"
    for name in ("last_step.safetensors", "final.safetensors"):
        assert_same(weights(out, name), weights(reference, name), name)


def test_report_rebuild_and_newest_checkpoint_read_one_file_checkpoints(reference, tmp_path):
    from helpers import run_process

    from loopkit.checkpoint import register_format
    from loopkit.checkpoint.format import registered_formats

    newest = os.path.join(reference, f"checkpoint-{MAX_STEPS}")
    loop = make_loop(reference, OneFileStorage())  # an interruption report names the newest checkpoint
    assert loop.context.preemption.newest_checkpoint() == newest
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "loopkit", "report", reference, "--force",
               "--storage", "test_one_file_storage:OneFileStorage"]
    os.remove(os.path.join(reference, "run_report.json"))  # the run's own report gone: rebuilt from the checkpoint
    result = run_process(command, "python -m loopkit report (one-file checkpoints)", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rebuilt = json.load(open(os.path.join(reference, "run_report.json")))
    assert rebuilt["global_step"] == MAX_STEPS and f"rebuilt from checkpoint-{MAX_STEPS}" in rebuilt["status"]
    assert rebuilt["best_checkpoint"] == json.load(open(os.path.join(reference, "best.json")))["best"]
    # In this process, once registered, the module-level readers find the format too.
    register_format(OneFileStorage)
    try:
        from loopkit.checkpoint import last_checkpoint

        assert last_checkpoint(reference) == newest
    finally:
        registered_formats.clear()


def test_the_earlier_protocol_names_answer_with_their_replacements():
    with pytest.raises(TypeError, match=r"write_files.*write_checkpoint"):
        type("OldStorage", (OneFileStorage,), {"write_files": lambda self, snapshot, folder: None})
    with pytest.raises(TypeError, match=r"take_snapshot.*states_to_save"):
        type("OldStorage", (OneFileStorage,), {"take_snapshot": lambda self, stage_states: None})
    with pytest.raises(TypeError, match=r"holds_model_weights.*recognises"):
        type("OldStorage", (OneFileStorage,), {"holds_model_weights": lambda self, path: True})
    with pytest.raises(ImportError, match=r"loopkit\.checkpoint\.engines\.load_sharded_model"):
        from loopkit.distributed import load_sharded_model  # noqa: F401


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, int(sys.argv[3]) if len(sys.argv) > 3 else None)
