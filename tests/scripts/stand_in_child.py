"""A fresh interpreter's run for tests/test_stand_in_callbacks.py: `python stand_in_child.py WHAT TESTS_FOLDER` prints
one JSON line.

Nothing here imports `transformers.trainer_utils` (or HF's callback module, which imports it) before the Loops that
must get loopkit's stand-ins are built (tests/helpers.py imports `Trainer`, so nothing of it is imported here either).
Each part first runs `Loop`s with `LoopArgs`, then imports HF's `Trainer` and runs the same configuration again on
`Loop` (now with HF's classes) and on `Trainer`:
* `runs`: events, control flags, log history, printed lines and progress-bar calls, per configuration;
* `integration`: a `report_to` integration, which imports HF's callback module while the Loop is built;
* `handles`: what user code finds after `from transformers import DefaultFlowCallback, ...` (isinstance, class
  equality, add / pop / remove traces), and a run whose callback reads `callback_handler.callbacks` mid-training.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import sys
import tempfile

import torch
import tqdm.auto
from interrupt_child import TinyRegression  # tests/helpers.py's model, without HF Trainer's imports

from loopkit import Loop, LoopArgs, TeardownStage

NOISY = ("transformers.trainer_utils", "transformers.trainer_callback", "transformers.trainer_optimizer",
         "transformers.training_args", "transformers.optimization", "transformers.quantizers",
         "transformers.integrations.peft")
NOISY_PACKAGES = ("peft", "bitsandbytes", "torchao", "kernels")
HF_EVENTS = ("on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
             "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_prediction_step",
             "on_evaluate", "on_save", "on_epoch_end", "on_train_end", "on_predict", "on_push_begin")
FLAGS = (("should_log", "L"), ("should_evaluate", "E"), ("should_save", "S"), ("should_training_stop", "T"),
         ("should_epoch_stop", "P"))
STEPS = dict(max_steps=6, per_device_train_batch_size=2, logging_steps=2, logging_first_step=True,
             eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4)
EPOCHS = dict(num_train_epochs=2, per_device_train_batch_size=4, logging_strategy="epoch", eval_strategy="epoch",
              save_strategy="epoch")
CONFIGS = {"steps, printer": dict(STEPS, disable_tqdm=True), "steps, bars": dict(STEPS, disable_tqdm=False),
           "epochs, printer": dict(EPOCHS, disable_tqdm=True), "epochs, bars": dict(EPOCHS, disable_tqdm=False)}


def noisy() -> list[str]:
    return sorted(name for name in sys.modules if name in NOISY or name.split(".")[0] in NOISY_PACKAGES)


def model():
    torch.manual_seed(0)
    return TinyRegression()


def data(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = 2 * x[:, 0] - x[:, 1] + 1 + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


class Recorder:
    """A user's callback that is not a `TrainerCallback` (importing that class would import HF's callback module):
    every HF event as (name, global_step, epoch, control flags, logged or metric keys)."""

    def __init__(self):
        self.events = []


def recording_method(name):
    def method(self, args, state, control, **kwargs):
        payload = kwargs.get("logs", kwargs.get("metrics"))
        flags = "".join(letter for flag, letter in FLAGS if getattr(control, flag))
        self.events.append([name, state.global_step, state.epoch, flags, None if payload is None else list(payload)])

    method.__name__ = name
    return method


for _event in HF_EVENTS:
    setattr(Recorder, _event, recording_method(_event))


class RecordingBar(tqdm.auto.tqdm):
    """tqdm, recording what the progress callback asks of it: opened (total, leave), updates, lines written, closed."""

    calls: list = []

    def __init__(self, *args, **kwargs):
        RecordingBar.calls.append(["open", kwargs.get("total"), kwargs.get("leave", True)])
        super().__init__(*args, **kwargs)

    def update(self, n=1):
        RecordingBar.calls.append(["update", n])
        return super().update(n)

    def close(self):
        if not self.disable:  # a closed bar is disabled; tqdm's __del__ closes again
            RecordingBar.calls.append(["close"])
        super().close()

    @classmethod
    def write(cls, s, file=None, end="\n", nolock=False):
        RecordingBar.calls.append(["write", without_timings(ast.literal_eval(s))])
        super().write(s, file, end, nolock)


def without_timings(logs: dict) -> dict:
    return {k: v for k, v in logs.items() if "runtime" not in k and "per_second" not in k}


def printed_logs(text: str) -> list[dict]:
    return [without_timings(ast.literal_eval(line)) for line in text.splitlines() if line.startswith("{")]


def loop(args: LoopArgs, callbacks) -> Loop:
    return Loop(model(), args, train_dataset=data(16, 0), eval_dataset=data(6, 1), callbacks=callbacks,
                teardown=TeardownStage(charts=False))


def trainer(args, callbacks):
    from transformers import Trainer

    return Trainer(model(), args, train_dataset=data(16, 0), eval_dataset=data(6, 1), callbacks=callbacks)


def record(build, config: dict, out: str, peek: bool = False) -> dict:
    """Build with `build(args_fields, callbacks)`, train, evaluate, predict; what the callbacks did and printed."""
    recorder, peeker = Recorder(), Peeker()
    fields = dict(output_dir=out, report_to="none", **config)
    runner = build(fields, [recorder, peeker] if peek else [recorder])
    peeker.runner = runner
    classes = [f"{type(cb).__module__}.{type(cb).__name__}" for cb in runner.callback_handler.callback_objects] \
        if isinstance(runner, Loop) else None
    RecordingBar.calls = []
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        output = runner.train()
        runner.evaluate()
        runner.predict(data(4, 2))
    return {"classes at construction": classes, "events": recorder.events, "bar": RecordingBar.calls,
            "printed": printed_logs(stdout.getvalue()), "train metrics": list(output.metrics),
            "log history": [without_timings(logs) for logs in runner.state.log_history], "peeked": peeker.seen}


class Peeker(Recorder):
    """A user's callback that reads `callback_handler.callbacks` in `on_step_end` of step 2, mid-training, and checks
    them the way user code does (after importing HF's classes)."""

    runner = None

    def __init__(self):
        super().__init__()
        self.seen = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:
            import_hf_callbacks()
            from transformers import DefaultFlowCallback, PrinterCallback, ProgressCallback

            self.seen = [[type(cb).__name__, isinstance(cb, DefaultFlowCallback), type(cb) == DefaultFlowCallback,
                          isinstance(cb, (ProgressCallback, PrinterCallback))]
                         for cb in self.runner.callback_handler.callbacks]


def import_hf_callbacks() -> None:
    """Import HF's callback module, its bars drawn with `RecordingBar` (as the stand-ins' are: see the end)."""
    import transformers.trainer_callback

    transformers.trainer_callback.tqdm = RecordingBar


def loop_builder(fields, callbacks):
    return loop(LoopArgs(**fields), callbacks)


def trainer_builder(fields, callbacks):
    from transformers import TrainingArguments

    return trainer(TrainingArguments(**fields), callbacks)


def runs() -> dict:
    found = {}
    with tempfile.TemporaryDirectory() as out:
        for name, config in CONFIGS.items():
            found[name] = {"stand-ins": record(loop_builder, config, f"{out}/stand-ins {name}")}
        found["noisy after the stand-in runs"] = noisy()
        import_hf_callbacks()
        for name, config in CONFIGS.items():
            found[name]["hf classes"] = record(loop_builder, config, f"{out}/hf classes {name}")
            found[name]["trainer"] = record(trainer_builder, config, f"{out}/trainer {name}")
    return found


def handles() -> dict:
    """Loops built with stand-ins; then HF's classes imported and compared on them and on a Trainer."""
    found = {}
    with tempfile.TemporaryDirectory() as out:
        built = {tqdm_off: loop(LoopArgs(output_dir=f"{out}/{tqdm_off}", report_to="none", disable_tqdm=tqdm_off),
                                [Recorder]) for tqdm_off in (False, True)}
        operated = {tqdm_off: loop(LoopArgs(output_dir=f"{out}/ops {tqdm_off}", report_to="none",
                                            disable_tqdm=tqdm_off), [Recorder]) for tqdm_off in (False, True)}
        found["stand-ins at construction"] = [
            [f"{type(cb).__module__}.{type(cb).__name__}" for cb in each.callback_handler.callback_objects]
            for each in (*built.values(), *operated.values())]
        found["noisy before HF's classes are imported"] = noisy()
        mid_run = record(loop_builder, dict(STEPS, disable_tqdm=False), f"{out}/mid-run", peek=True)

        import_hf_callbacks()
        from transformers import TrainingArguments

        sys.path.insert(0, sys.argv[2])  # the tests folder: its live comparison, run on these Loops
        from test_default_callbacks import HF_CLASSES, operations

        for tqdm_off in (False, True):
            hf = trainer(TrainingArguments(f"{out}/hf {tqdm_off}", report_to="none", disable_tqdm=tqdm_off),
                         [Recorder])
            hf_ops = trainer(TrainingArguments(f"{out}/hf ops {tqdm_off}", report_to="none", disable_tqdm=tqdm_off),
                             [Recorder])
            found[f"disable_tqdm={tqdm_off}"] = {
                "isinstance": [isinstance_grid(each, HF_CLASSES) for each in (built[tqdm_off], hf)],
                "operations": [repr(list(operations(each))) for each in (operated[tqdm_off], hf_ops)]}
        found["mid-run swap"] = {"loop": mid_run,
                                 "trainer": record(trainer_builder, dict(STEPS, disable_tqdm=False),
                                                   f"{out}/mid-run trainer", peek=True)}
    return found


def integration() -> dict:
    """A `report_to` integration imports HF's callback module while the Loop is built (after its progress callback
    was made): every default is then HF's class from the start, as on Trainer."""
    with tempfile.TemporaryDirectory() as out:
        fields = dict(output_dir=out, report_to="tensorboard", disable_tqdm=False)
        built = loop(LoopArgs(**fields), [Recorder])
        from transformers import TrainingArguments

        hf = trainer(TrainingArguments(**fields), [Recorder])
        return {name: [f"{type(cb).__module__}.{type(cb).__name__}" for cb in callbacks] for name, callbacks in
                (("loop", built.callback_handler.callback_objects), ("trainer", hf.callback_handler.callbacks))}


def isinstance_grid(runner, classes) -> list:
    from transformers import DefaultFlowCallback

    return [[type(cb).__name__, [isinstance(cb, cls) for cls in classes], type(cb) == DefaultFlowCallback]
            for cb in runner.callback_handler.callbacks]


if __name__ == "__main__":
    import loopkit.default_callbacks

    loopkit.default_callbacks.tqdm = RecordingBar  # what the stand-in progress bars are drawn with
    print(json.dumps({"runs": runs, "handles": handles, "integration": integration}[sys.argv[1]]()))
