"""What transformers' own trainer tests and example scripts do at the edges (issue 27, point 5), each run with HF
Trainer and with `Loop` in the same test: the same outcome, the same warning or error type and words.

A `TrainingArguments` subclass with fields of its own, `evaluate()` / `predict()` on an `IterableDataset` without
`__len__` (with the progress bar, as in HF's suite), an overridden `get_train_dataloader` returning a loader
without `.dataset`, the evaluation loader kept under `dataloader_persistent_workers`, a resume with another batch
size or other intervals (Trainer's warning), `accelerator_config`'s `num_steps`, and Trainer's exception type and
message for a missing checkpoint, `num_steps` next to `gradient_accumulation_steps > 1`, and a
`metric_for_best_model` the evaluation does not produce.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import transformers
from torch import nn
from torch.utils.data import IterableDataset
from transformers import PreTrainedConfig, PreTrainedModel, TrainingArguments

from loopkit import Loop, LoopConfigError

from helpers import IGNORE_PIN_MEMORY_WARNING, hf_args, regression_data, runners, tiny_regression

pytestmark = IGNORE_PIN_MEMORY_WARNING


def logged_losses(trainer) -> dict:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


# ---------------------------------------------------------------------------------------------------------------
# A TrainingArguments subclass with fields of its own
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ScriptArguments(TrainingArguments):
    """What example scripts do: the script's own options on the same dataclass (`HfArgumentParser` fills it)."""

    model_name_or_path: str = "tiny-regression"
    threshold: float = 0.25
    layers_to_freeze: list = field(default_factory=list)

    def __post_init__(self):
        super().__post_init__()
        self.threshold_squared = self.threshold ** 2


class ScriptLoop(Loop):
    """The script declares the arguments class whose own fields it reads (`args_class`, docs/arguments.md)."""

    args_class = ScriptArguments


def test_training_arguments_subclass_with_its_own_fields_trains_as_trainer(tmp_path):
    """Fields Trainer never reads are the script's: a Loop that declares the class (`args_class`) trains with them
    set as Trainer does; a plain Loop refuses them by name, with that fix, rather than ignore them (issue 42)."""
    trained = {}
    for name, runner in (("hf", dict(runners())["hf"]), ("loopkit", ScriptLoop)):
        args = ScriptArguments(output_dir=str(tmp_path / name), report_to="none", disable_tqdm=True,
                               model_name_or_path="mine", threshold=0.5, layers_to_freeze=["linear"], max_steps=4,
                               per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                               learning_rate=0.05)
        trainer = runner(model=tiny_regression(), args=args, train_dataset=regression_data(16))
        trainer.train()
        trained[name] = trainer
    assert logged_losses(trained["loopkit"]) == pytest.approx(logged_losses(trained["hf"]), rel=1e-6)
    assert len(logged_losses(trained["hf"])) == 4
    with pytest.raises(LoopConfigError, match=r"model_name_or_path='mine', threshold=0\.5, layers_to_freeze=\['linear'\]"
                       r".*class MyLoop\(Loop\): args_class = ScriptArguments"):
        Loop(model=tiny_regression(), args=ScriptArguments(output_dir=str(tmp_path / "plain"), report_to="none",
                                                           model_name_or_path="mine", threshold=0.5,
                                                           layers_to_freeze=["linear"]))
    # A value loopkit refuses stays refused on a subclass too.
    args = ScriptArguments(output_dir=str(tmp_path / "refused"), report_to="none", threshold=0.5)
    args.debug = ["tpu_metrics_debug"]
    with pytest.raises(LoopConfigError, match="debug='tpu_metrics_debug'"):
        ScriptLoop(model=tiny_regression(), args=args)


# ---------------------------------------------------------------------------------------------------------------
# A regression model and data in the shape of HF's trainer tests: a PreTrainedModel returning tuples
# ---------------------------------------------------------------------------------------------------------------
class LineConfig(PreTrainedConfig):
    def __init__(self, a=0.0, b=0.0, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b, self.hidden_size = a, b, 1


class LineModel(PreTrainedModel):
    """y = a x + b with an MSE loss, returning `(loss, y)` / `(y,)` tuples."""

    config_class = LineConfig
    base_model_prefix = "line"

    def __init__(self, config):
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(float(config.a)))
        self.b = nn.Parameter(torch.tensor(float(config.b)))
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


def line_model(a=0.0, b=0.0) -> LineModel:
    model = LineModel(LineConfig(a=a, b=b))
    model.accepts_loss_kwargs = False  # its loss is a plain batch mean
    return model


class LineRows:
    """`length` rows {input_x, labels (, extra)} of y = 2x + 3 + noise; a map-style dataset that is not a list."""

    def __init__(self, length=64, seed=42, label_names=("labels",)):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.ys = {name: (2 * self.x + 3 + rng.normal(scale=0.1, size=length)).astype(np.float32)
                   for name in label_names}

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {**{name: y[i] for name, y in self.ys.items()}, "input_x": self.x[i]}


class LineStream(IterableDataset):
    """The same rows as a stream without `__len__`."""

    def __init__(self, length=64, label_names=("labels",)):
        self.rows = LineRows(length, label_names=label_names)

    def __iter__(self):
        return (self.rows[i] for i in range(len(self.rows)))


def almost_accuracy(prediction):
    predictions, labels = prediction
    return {"accuracy": float((np.abs(predictions - labels) <= 0.25).mean())}


def test_evaluate_and_predict_on_a_stream_without_len_as_trainer(tmp_path):
    """HF evaluates a dataset without `__len__`, progress bar on (HF's suite runs with it); main raised
    "TypeError: object of type 'LineStream' has no len()" from the bar's total."""
    results = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, disable_tqdm=False, per_device_eval_batch_size=8)
        trainer = runner(model=line_model(1.5, 2.5), args=args, compute_metrics=almost_accuracy,
                         eval_dataset=LineStream(label_names=("labels", "extra")))
        default = trainer.evaluate()
        uneven = trainer.evaluate(LineStream(66))  # not a multiple of the batch size
        predicted = trainer.predict(LineStream(66))
        results[name] = (default, uneven, predicted)
    for hf, ours in zip(results["hf"][:2], results["loopkit"][:2]):
        assert ours["eval_loss"] == pytest.approx(hf["eval_loss"], rel=1e-6)
        assert ours["eval_accuracy"] == hf["eval_accuracy"]
    hf, ours = results["hf"][2], results["loopkit"][2]
    assert ours.predictions.shape == hf.predictions.shape == (66,)
    np.testing.assert_allclose(ours.predictions, hf.predictions, rtol=1e-6)
    np.testing.assert_array_equal(ours.label_ids, hf.label_ids)
    assert ours.metrics["test_loss"] == pytest.approx(hf.metrics["test_loss"], rel=1e-6)
    # The expected values themselves, from the line the model computes.
    rows = LineRows(66)
    assert results["hf"][1]["eval_loss"] == pytest.approx(float(((1.5 * rows.x + 2.5 - rows.ys["labels"]) ** 2)
                                                                 .mean()), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# get_train_dataloader overridden to return a loader without .dataset
# ---------------------------------------------------------------------------------------------------------------
class Concatenated:
    """Several loaders read one after the other: `__iter__` and `__len__`, no `.dataset`."""

    def __init__(self, loaders):
        self.loaders = loaders

    def __len__(self):
        return sum(len(loader) for loader in self.loaders)

    def __iter__(self):
        for loader in self.loaders:
            yield from loader


def twice_per_epoch(runner):
    class TwicePerEpoch(runner):
        def get_train_dataloader(self):
            return Concatenated([super().get_train_dataloader(), super().get_train_dataloader()])

        def get_eval_dataloader(self, eval_dataset):  # no default, as in HF's tests: it is always passed
            return Concatenated([super().get_eval_dataloader(eval_dataset), super().get_eval_dataloader(eval_dataset)])

    return TwicePerEpoch


def test_train_dataloader_without_dataset_attribute_trains_as_trainer(tmp_path):
    """Main failed in the step arithmetic: "AttributeError: 'Concatenated' object has no attribute 'dataset'"."""
    trained = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, num_train_epochs=2, per_device_train_batch_size=8, logging_steps=1,
                       save_strategy="no", learning_rate=0.1, eval_strategy="epoch")
        trainer = twice_per_epoch(runner)(model=line_model(), args=args, train_dataset=LineRows(32),
                                          eval_dataset=LineRows(16, seed=1))
        output = trainer.train()
        trained[name] = (trainer, output, trainer.evaluate())
    (hf, hf_output, hf_eval), (ours, our_output, our_eval) = trained["hf"], trained["loopkit"]
    assert our_output.global_step == hf_output.global_step == 16  # 2 epochs of 2 x 4 batches
    assert logged_losses(ours) == pytest.approx(logged_losses(hf), rel=1e-6)
    assert [h["epoch"] for h in ours.state.log_history] == [h["epoch"] for h in hf.state.log_history]
    evaluated = {name: [h["eval_loss"] for h in run[0].state.log_history if "eval_loss" in h]  # 2 epochs, evaluate()
                 for name, run in trained.items()}
    assert len(evaluated["hf"]) == 3 and evaluated["loopkit"] == pytest.approx(evaluated["hf"], rel=1e-6)
    assert our_eval["eval_loss"] == pytest.approx(hf_eval["eval_loss"], rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# dataloader_persistent_workers: the evaluation loader is kept
# ---------------------------------------------------------------------------------------------------------------
def test_persistent_workers_keep_the_eval_loader_as_trainer(tmp_path):
    """Trainer keeps one loader per evaluation dataset name when workers persist (its workers then live across
    evaluations); main built a new loader for `get_eval_dataloader(eval_dataset)`. No loader is iterated here, so
    no worker starts."""
    single, named = LineRows(16), {"first": LineRows(16, seed=1), "second": LineRows(16, seed=2)}
    for name, runner in runners():
        for persistent in (True, False):
            args = hf_args(tmp_path / name, dataloader_persistent_workers=persistent, dataloader_num_workers=2)
            trainer = runner(model=line_model(), args=args, eval_dataset=single)
            default = trainer.get_eval_dataloader()
            assert (trainer.get_eval_dataloader(single) is default) is persistent, (name, persistent)
            assert (trainer.get_eval_dataloader() is default) is persistent, (name, persistent)
            trainer = runner(model=line_model(), args=args, eval_dataset=named)
            first, second = trainer.get_eval_dataloader("first"), trainer.get_eval_dataloader("second")
            assert first is not second and first.dataset is named["first"] and second.dataset is named["second"]
            assert (trainer.get_eval_dataloader("first") is first) is persistent, (name, persistent)
            assert (trainer.get_eval_dataloader("second") is second) is persistent, (name, persistent)
    # Where loopkit differs on purpose (docs/differences.md): another dataset passed in gets its own loader; HF
    # hands back the kept one, which reads the first dataset.
    other = LineRows(8, seed=3)
    kept = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, dataloader_persistent_workers=True, dataloader_num_workers=2)
        trainer = runner(model=line_model(), args=args, eval_dataset=single)
        trainer.get_eval_dataloader()
        kept[name] = trainer.get_eval_dataloader(other).dataset
    assert kept["hf"] is single and kept["loopkit"] is other


class LoaderSeen(transformers.TrainerCallback):
    """The evaluation loader each evaluation read (as HF hands it to callbacks)."""

    def __init__(self):
        self.loaders = []

    def on_evaluate(self, args, state, control, eval_dataloader=None, **kwargs):
        self.loaders.append(eval_dataloader)


def test_evaluations_during_training_share_one_loader_with_persistent_workers(tmp_path):
    """Three evaluations in training read one loader (one set of worker processes), as in Trainer."""
    for name, runner in runners():
        seen = LoaderSeen()
        args = hf_args(tmp_path / name, dataloader_persistent_workers=True, dataloader_num_workers=1, max_steps=3,
                       eval_strategy="steps", eval_steps=1, save_strategy="no", per_device_train_batch_size=8)
        runner(model=line_model(), args=args, train_dataset=LineRows(16), eval_dataset=LineRows(8, seed=1),
               callbacks=[seen]).train()
        assert len(seen.loaders) == 3 and all(loader is seen.loaders[0] for loader in seen.loaders), name


# ---------------------------------------------------------------------------------------------------------------
# Resuming with another batch size or other intervals: Trainer's warning, the run goes on
# ---------------------------------------------------------------------------------------------------------------
class TransformersRecords(logging.Handler):
    """The records of transformers' loggers (they do not propagate to the root logger), WARNING and up."""

    def __enter__(self):
        self.records = []
        self.logger = logging.getLogger("transformers")
        self.saved_level = self.logger.level
        self.logger.addHandler(self)
        self.logger.setLevel(logging.WARNING)
        transformers.utils.logging.warning_once.cache_clear()  # each runner's warning is then emitted
        return self

    def emit(self, record):
        self.records.append((record.name, record.levelname, record.getMessage()))

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.saved_level)


def checkpoint_then_resume(tmp_path, runner, name, **changed):
    """Train 6 steps of 4 samples over 16 (a checkpoint at step 3), then resume from it with `changed` args."""
    base = dict(max_steps=6, per_device_train_batch_size=4, save_steps=3, logging_steps=1, learning_rate=0.05)
    first = runner(model=tiny_regression(), args=hf_args(tmp_path / name, **base), train_dataset=regression_data(16))
    first.train()
    resumed = runner(model=tiny_regression(), args=hf_args(tmp_path / name, **{**base, **changed}),
                     train_dataset=regression_data(16))
    with TransformersRecords() as log, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = resumed.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-3"))
    python_warnings = [str(w.message) for w in caught if "pin_memory" not in str(w.message)]
    return resumed, output, log.records, python_warnings


def test_resume_with_another_batch_size_and_intervals_warns_as_trainer(tmp_path):
    """Main refused the batch size ("per_device_train_batch_size=8: the checkpoint stopped after 12 samples of
    epoch 0, which is not a whole number of micro-batches") and warned about nothing."""
    runs = {name: checkpoint_then_resume(tmp_path, runner, name, per_device_train_batch_size=8, logging_steps=2,
                                         save_steps=2)
            for name, runner in runners()}
    (hf, hf_output, hf_records, _), (ours, our_output, our_records, ours_warned) = runs["hf"], runs["loopkit"]
    assert our_output.global_step == hf_output.global_step == 6
    assert our_records == hf_records and len(hf_records) == 1
    logger, level, message = hf_records[0]
    assert logger == "transformers.trainer_utils" and level == "WARNING"
    for line in ("logging_steps: 2 (from args) != 1", "save_steps: 2 (from args) != 3",
                 "per_device_train_batch_size: 8 (from args) != 4"):
        assert line in message
    # As in Trainer, the checkpoint's intervals win: a loss is logged at every step after the resume.
    assert sorted(logged_losses(ours)) == sorted(logged_losses(hf)) == [1, 2, 3, 4, 5, 6]
    assert ours.state.train_batch_size == hf.state.train_batch_size == 4
    # What differs (docs/differences.md): loopkit resumes at the checkpoint's sample, 12, rounded down to whole
    # batches of 8 (and says so); Trainer skips 3 steps counted in batches of 8, i.e. into the second epoch.
    assert ours_warned == ["The checkpoint stopped after 12 samples of epoch 0, not a whole number of this run's "
                           "micro-batches of 8 samples: resuming after 8 samples, so 4 of them are trained on "
                           "again."]
    assert ours.state.epoch == 2.0 and hf.state.epoch == 3.0  # 12 + 8 + 16 samples = 2 epochs; Trainer's count


class SampleRecorder:
    """HF's default collator, recording the first feature of each sample it collates (which samples, in order)."""

    def __init__(self):
        self.seen = []

    def __call__(self, features):
        from transformers import default_data_collator

        self.seen += [round(float(f["x"][0]), 6) for f in features]
        return default_data_collator(features)


def test_resume_with_a_smaller_batch_continues_at_the_checkpoints_sample(tmp_path):
    """docs/differences.md's claim: 12 samples trained in batches of 4, resumed in batches of 2, continue with the
    13th sample of the epoch's order and then the next epoch's, as an uninterrupted run reads them."""
    data = regression_data(16)
    reference = SampleRecorder()
    Loop(model=tiny_regression(), args=hf_args(tmp_path / "whole", max_steps=8, per_device_train_batch_size=4,
                                               save_strategy="no"), train_dataset=data,
         data_collator=reference).train()
    first = Loop(model=tiny_regression(), args=hf_args(tmp_path / "cut", max_steps=8, per_device_train_batch_size=4,
                                                       save_steps=3), train_dataset=data)
    first.train()
    resumed_order = SampleRecorder()
    resumed = Loop(model=tiny_regression(), args=hf_args(tmp_path / "cut", max_steps=13,
                                                         per_device_train_batch_size=2), train_dataset=data,
                   data_collator=resumed_order)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # an exact resume has nothing to warn about
        warnings.filterwarnings("ignore", "'pin_memory'", UserWarning)
        resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    assert resumed.state.global_step == 13 and resumed.state.epoch == 2.0
    assert resumed_order.seen == reference.seen[12:32] and len(reference.seen) == 32


def test_resume_with_other_intervals_only_warns_as_trainer(tmp_path):
    runs = {name: checkpoint_then_resume(tmp_path, runner, name, logging_steps=2)
            for name, runner in runners()}
    assert runs["loopkit"][2] == runs["hf"][2] and len(runs["hf"][2]) == 1
    assert runs["hf"][2][0][2].endswith("\n\tlogging_steps: 2 (from args) != 1 (from trainer_state.json)")
    assert runs["loopkit"][3] == []  # same batch size: the position is exact, nothing else to say
    assert logged_losses(runs["loopkit"][0]) == pytest.approx(logged_losses(runs["hf"][0]), rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# accelerator_config's gradient_accumulation_kwargs num_steps
# ---------------------------------------------------------------------------------------------------------------
def test_accelerator_config_num_steps_is_taken_as_trainer_takes_it(tmp_path):
    """num_steps=2 becomes gradient_accumulation_steps=2 (and num_steps 1, in place) at construction; main refused
    it ("num_steps would be a second gradient-accumulation setting")."""
    trained = {}
    for name, runner in runners():
        config = {"gradient_accumulation_kwargs": {"num_steps": 2}}
        args = hf_args(tmp_path / name, accelerator_config=config, max_steps=3, per_device_train_batch_size=2,
                       logging_steps=1, save_strategy="no", learning_rate=0.05)
        trainer = runner(model=tiny_regression(), args=args, train_dataset=regression_data(16))
        assert args.gradient_accumulation_steps == 2
        assert args.accelerator_config.gradient_accumulation_kwargs == {"num_steps": 1}
        trainer.train()
        trained[name] = trainer
    assert logged_losses(trained["loopkit"]) == pytest.approx(logged_losses(trained["hf"]), rel=1e-6)
    assert trained["loopkit"].state.log_history[-1]["train_loss"] == pytest.approx(
        trained["hf"].state.log_history[-1]["train_loss"], rel=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Trainer's exception type and message, with loopkit's field and fix
# ---------------------------------------------------------------------------------------------------------------
def no_checkpoint_in_output_dir(runner, folder):
    runner(model=tiny_regression(), args=hf_args(folder), train_dataset=regression_data(8)).train(
        resume_from_checkpoint=True)


def no_checkpoint_at_path(runner, folder):
    runner(model=tiny_regression(), args=hf_args(folder), train_dataset=regression_data(8)).train(
        resume_from_checkpoint=str(folder / "checkpoint-7"))


def num_steps_and_accumulation(runner, folder):
    args = hf_args(folder, gradient_accumulation_steps=2,
                   accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2}})
    runner(model=tiny_regression(), args=args)


def best_metric_not_produced(runner, folder, **extra):
    args = hf_args(folder, max_steps=2, eval_strategy="steps", eval_steps=1, save_strategy="no",
                   metric_for_best_model="accuracy", **extra)
    runner(model=tiny_regression(), args=args, train_dataset=regression_data(8),
           eval_dataset=regression_data(4, seed=1)).train()


def plateau_metric_not_produced(runner, folder):
    best_metric_not_produced(runner, folder, lr_scheduler_type="reduce_lr_on_plateau")


@pytest.mark.parametrize("situation", [no_checkpoint_in_output_dir, no_checkpoint_at_path,
                                       num_steps_and_accumulation, best_metric_not_produced,
                                       plateau_metric_not_produced])
def test_errors_carry_trainers_type_and_message(tmp_path, situation):
    raised = {}
    for name, runner in runners():  # the same folder: the paths in the messages are the same
        with pytest.raises(Exception) as error:
            situation(runner, tmp_path / "out")
        raised[name] = error.value
    hf, ours = raised["hf"], raised["loopkit"]
    assert type(hf) in (ValueError, KeyError)
    assert isinstance(ours, type(hf)) and isinstance(ours, LoopConfigError)
    assert ours.args[0].startswith(hf.args[0])  # Trainer's words first, then loopkit's field and fix
    assert "Fix:" in ours.args[0][len(hf.args[0]):]
