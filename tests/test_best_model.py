"""The best model and checkpoint rotation: `metric_for_best_model`, `greater_is_better`, `load_best_model_at_end`,
`save_strategy="best"`, `save_total_limit`, and loopkit's separate limit for best checkpoints.

Each evaluation reports a scripted score chosen by the step, so the best checkpoint is known in advance. Where HF
Trainer 5.24 is right, loopkit must keep exactly HF's folders after every save and at the end (run live). Where HF
is wrong (a run resumed into a new output_dir with save_total_limit=1 ends with no checkpoint at all), loopkit's
behaviour is asserted directly.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import hf_args, regression_data, tiny_regression
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

from loopkit import EvalStage, Loop

BASE = dict(per_device_train_batch_size=4, logging_steps=100, eval_strategy="steps", metric_for_best_model="score",
            use_cpu=True)


class SaveRecorder(TrainerCallback):
    """After every save (rotation done): the step, the checkpoint folders, and the recorded best checkpoint."""

    def __init__(self):
        self.saves = []

    def on_save(self, args, state, control, **kwargs):
        best = state.best_model_checkpoint
        self.saves.append((state.global_step, checkpoints(args.output_dir), best and os.path.basename(best)))


def checkpoints(output_dir) -> list[str]:
    names = [n for n in os.listdir(output_dir) if n.startswith("checkpoint-")] if os.path.isdir(output_dir) else []
    return sorted(names, key=lambda n: int(n.split("-")[1]))


def run(runner, output_dir, scores: dict, resume=None, loop_kwargs=None, **args):
    """Train a tiny regression whose evaluation at step s reports `scores[s]` as `eval_score`."""
    trainer = None

    def compute_metrics(_):
        return {"score": scores[trainer.state.global_step]}

    recorder = SaveRecorder()
    trainer = runner(tiny_regression(), hf_args(output_dir, **{**BASE, **args}), train_dataset=regression_data(48),
                     eval_dataset=regression_data(4, seed=1), compute_metrics=compute_metrics, callbacks=[recorder],
                     **(loop_kwargs or {}))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, recorder.saves


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# Scenarios where HF Trainer 5.24 is right: loopkit must keep exactly its folders.
SCENARIOS = {
    # Saves every 2 steps, evaluations every 4: the best is known only at every second save.
    "save_2_eval_4_limit_2": (dict(save_steps=2, eval_steps=4, max_steps=10, save_total_limit=2),
                              {4: 0.5, 8: 0.1, 10: 0.2}),
    "save_2_eval_4_limit_1": (dict(save_steps=2, eval_steps=4, max_steps=10, save_total_limit=1),
                              {4: 0.1, 8: 0.5, 10: 0.3}),
    # The best is the very first checkpoint; it must survive every later save and be the one loaded at the end.
    "best_at_first_save_limit_1": (dict(save_steps=2, eval_steps=2, max_steps=8, save_total_limit=1,
                                        load_best_model_at_end=True), {2: 0.9, 4: 0.1, 6: 0.2, 8: 0.3}),
    # Only new bests are saved (transformers issue 35070): one folder, the best.
    "save_best_only_limit_1": (dict(save_strategy="best", eval_steps=2, max_steps=8, save_total_limit=1,
                                    load_best_model_at_end=True), {2: 0.1, 4: 0.5, 6: 0.3, 8: 0.6}),
    # A lower-is-better metric, the best evaluated between saves (never saved itself).
    "lower_is_better_eval_between_saves": (dict(save_steps=4, eval_steps=2, max_steps=8, save_total_limit=1,
                                                greater_is_better=False), {2: 0.1, 4: 0.5, 6: 0.3, 8: 0.4}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_rotation_and_best_model_match_hf(tmp_path, scenario):
    args, scores = SCENARIOS[scenario]
    results = {}
    for name, runner in (("hf", Trainer), ("loopkit", Loop)):
        trainer, saves = run(runner, tmp_path / name, scores, **args)
        results[name] = dict(saves=saves, final=checkpoints(tmp_path / name), best_metric=trainer.state.best_metric,
                             best=trainer.state.best_model_checkpoint, weights=weights(trainer.model))
    hf, lk = results["hf"], results["loopkit"]
    assert lk["saves"] == hf["saves"], "folders kept after each save"
    assert lk["final"] == hf["final"], "folders kept at the end"
    assert lk["best_metric"] == hf["best_metric"]
    assert (lk["best"] and os.path.basename(lk["best"])) == (hf["best"] and os.path.basename(hf["best"]))

    # What HF gets right here, stated: the best and the newest survive every save.
    scored_saves = [step for step, _, best in lk["saves"] if best is not None]
    for step, folders, best in lk["saves"]:
        assert f"checkpoint-{step}" in folders, f"the newest checkpoint was deleted at step {step}"
        assert best is None or best in folders, f"the best checkpoint was deleted at step {step}"
    if args.get("load_best_model_at_end"):
        best_file = os.path.join(lk["best"], "model.safetensors")
        for name in ("hf", "loopkit"):
            for key, value in load_file(best_file).items():
                assert torch.equal(results[name]["weights"][key], value), f"{name}: final weights are not the best"
        assert scored_saves, "the scenario must record a best checkpoint"


def test_separate_limits_keep_the_k_best_and_the_newest(tmp_path):
    """`EvalStage(best_total_limit=2)` with `save_total_limit=1`: after every save, the newest checkpoint plus the
    two best-scoring ones remain, and the end of training deletes nothing more (HF's limit-1 rule is off)."""
    scores = {2: 0.1, 4: 0.9, 6: 0.2, 8: 0.8, 10: 0.3, 12: 0.85}
    trainer, saves = run(Loop, tmp_path, scores, save_steps=2, eval_steps=2, max_steps=12, save_total_limit=1,
                         loop_kwargs=dict(evaluation=EvalStage(best_total_limit=2)))
    for step, folders, _ in saves:
        saved_so_far = [s for s in scores if s <= step]
        two_best = sorted(saved_so_far, key=lambda s: -scores[s])[:2]
        expected = sorted({step, *two_best})
        assert folders == [f"checkpoint-{s}" for s in expected], f"after the save at step {step}"
    assert checkpoints(tmp_path) == ["checkpoint-4", "checkpoint-12"]
    assert trainer.state.best_metric == 0.9


def test_best_total_limit_is_validated():
    with pytest.raises(ValueError, match="best_total_limit"):
        EvalStage(best_total_limit=0)


def test_resume_into_new_output_dir_with_limit_1_keeps_a_checkpoint(tmp_path):
    """Resume from run A's checkpoint-4 (the best) with output_dir B and save_total_limit=1. HF 5.24 then deletes
    every checkpoint of B at the end ("all but the best", and the best lies in A: the bug of transformers PR 25136
    in a new form). loopkit keeps B's newest checkpoint, and the best stays A's."""
    scores = {2: 0.5, 4: 0.9, 6: 0.1, 8: 0.2}
    args = dict(save_steps=2, eval_steps=2, save_total_limit=1)
    ends = {}
    for name, runner in (("hf", Trainer), ("loopkit", Loop)):
        run(runner, tmp_path / name / "a", scores, max_steps=4, **args)
        assert checkpoints(tmp_path / name / "a") == ["checkpoint-4"]
        trainer, _ = run(runner, tmp_path / name / "b", scores, max_steps=8,
                         resume=str(tmp_path / name / "a" / "checkpoint-4"), **args)
        ends[name] = (checkpoints(tmp_path / name / "b"), trainer.state.best_model_checkpoint)
    assert ends["hf"][0] == [], "HF's behaviour changed: this test documents a bug that seems fixed"
    assert ends["loopkit"] == (["checkpoint-8"], str(tmp_path / "loopkit" / "a" / "checkpoint-4"))
