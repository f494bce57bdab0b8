"""HF Trainer's default callbacks, and loopkit's stand-ins for them that import nothing noisy.

A `Loop`'s default callbacks are HF's `DefaultFlowCallback` and `ProgressCallback` / `PrinterCallback` (the
notebook display is HF's own class: loopkit/trainer/notebook.py). Their module, `transformers.trainer_callback`, imports
`transformers.trainer_utils`, which imports peft when it is installed, and peft imports bitsandbytes and torchao: on a
machine without their kernels that prints "Failed to load ... .so", torch pytree deprecations and "Failed to load CPU
gemm_4bit_forward". A `LoopArgs` run with `optim="adamw_torch"` needs none of it.

So the defaults are built by `default_callback(name)`:
* when `transformers.trainer_utils` is already imported (the user imported `TrainingArguments`, `Trainer`, a
  `TrainerCallback`, ...: the noise, if any, is already printed), HF's classes, built by HF;
* otherwise loopkit's stand-ins below: HF 5.24's classes copied line for line, with HF's names and attributes, so
  the run sets the same control flags and prints the same lines. The first time user code can see a callback object
  (`callback_handler.callbacks`, `add_callback`, `pop_callback`, `remove_callback`, `callback_handler.listeners`:
  loopkit/events.py), `become_hf_class` makes each stand-in an instance of HF's class of that name: its `__class__`
  is set, so the object, its place in the list and its state (a progress bar mid-run) stay. From then on
  `isinstance(cb, DefaultFlowCallback)` and `type(cb) == DefaultFlowCallback` hold, as with Trainer. (Setting
  `__class__` is allowed because both classes are plain Python classes with a `__dict__` and no `__slots__`.)

A stand-in costs what HF's class costs per event (the same statements; string comparisons where HF compares its
str-valued enums).
"""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

# Importing HF's callback module is quiet once this one is imported (it is the module that imports peft).
NOISY_DEPENDENCY = "transformers.trainer_utils"


def hf_classes_are_free() -> bool:
    """Whether HF's callback classes can be used without importing anything noisy."""
    return NOISY_DEPENDENCY in sys.modules


def default_callback(name: str):
    """A new default callback: HF's class `name` when importing it is free, else loopkit's stand-in."""
    if hf_classes_are_free():
        import transformers.trainer_callback as hf

        return getattr(hf, name)()
    return STAND_INS[name]()


def is_stand_in(callback) -> bool:
    """Whether `callback` is one of loopkit's stand-ins (exactly: a user's subclass of one is the user's class)."""
    return type(callback) in STAND_IN_CLASSES


def become_hf_class(callback) -> None:
    """Make the stand-in `callback` an instance of HF's class of the same name (imported here): its `__class__` is
    set, so the object, its place in any list and its attributes stay."""
    import transformers.trainer_callback as hf

    callback.__class__ = getattr(hf, type(callback).__name__)


def has_length(dataset) -> bool:
    """`transformers.trainer_utils.has_length` (5.24), copied: `ProgressCallback` decides its bar with it."""
    try:
        return len(dataset) is not None
    except TypeError:
        return False
    except AttributeError:
        return False


class DefaultFlowCallback:
    """HF's `DefaultFlowCallback` (5.24): when to log, evaluate, save and stop."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and state.global_step % state.logging_steps == 0:
            control.should_log = True
        if args.eval_strategy == "steps" and state.global_step % state.eval_steps == 0 \
                and args.eval_delay <= state.global_step:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps > 0 and state.global_step % state.save_steps == 0:
            control.should_save = True
        if state.global_step >= state.max_steps:
            control.should_training_stop = True
            # A final evaluation when the last step is not an evaluation step.
            if args.eval_strategy == "steps" and state.global_step % state.eval_steps != 0 \
                    and args.eval_delay <= state.global_step:
                control.should_evaluate = True
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= state.epoch:
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control


class ProgressCallback:
    """HF's `ProgressCallback` (5.24): a tqdm bar over optimizer steps, one over evaluation batches, and each log
    written above the bar."""

    def __init__(self, max_str_len: int = 100):
        self.training_bar = None
        self.prediction_bar = None
        self.max_str_len = max_str_len

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar = tqdm(total=state.max_steps, dynamic_ncols=True)
        self.current_step = 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar.update(state.global_step - self.current_step)
            self.current_step = state.global_step

    def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
        if state.is_world_process_zero and has_length(eval_dataloader):
            if self.prediction_bar is None:
                self.prediction_bar = tqdm(total=len(eval_dataloader), leave=self.training_bar is None,
                                           dynamic_ncols=True)
            self.prediction_bar.update(1)

    def on_evaluate(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            if self.prediction_bar is not None:
                self.prediction_bar.close()
            self.prediction_bar = None

    def on_predict(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            if self.prediction_bar is not None:
                self.prediction_bar.close()
            self.prediction_bar = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None:
            shown = {}  # a shallow copy: the caller's logs stay as they are
            for key, value in logs.items():
                if isinstance(value, str) and len(value) > self.max_str_len:
                    shown[key] = (f"[String too long to display, length: {len(value)} > {self.max_str_len}. "
                                  "Consider increasing `max_str_len` if needed.]")
                elif isinstance(value, float):
                    shown[key] = f"{value:.4g}"
                else:
                    shown[key] = value
            shown.pop("total_flos", None)
            self.training_bar.write(str(shown))

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.training_bar.close()
            self.training_bar = None


class PrinterCallback:
    """HF's `PrinterCallback` (5.24): prints each log (with `disable_tqdm=True`)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs.pop("total_flos", None)  # as HF: from the caller's dict (so from the train metrics too)
        if state.is_local_process_zero:
            if logs is not None:
                logs = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items()}
            print(logs)


STAND_IN_CLASSES = (DefaultFlowCallback, ProgressCallback, PrinterCallback)
STAND_INS = {cls.__name__: cls for cls in STAND_IN_CLASSES}
