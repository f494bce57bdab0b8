"""Weight averaging: an average of the weights kept beside the training weights, `Loop(..., averaging=EMA(0.999))`.

`EMA(decay)` keeps an exponential moving average (timm's `ModelEmaV3`, Composer's `EMA`, Lightning's
`EMAWeightAveraging`), `SWA()` the plain mean of the weights since `start_step` (`torch.optim.swa_utils`'s
`AveragedModel`; the learning rate is the run's own: no `SWALR`, and buffers such as batch-norm statistics are not
recomputed). What it does in a run (docs/weight-averaging.md):

* After each optimizer step (`on_step_end`, once per accumulation window) past `start_step`, every `every_n_steps`
  steps, the average moves towards the weights the optimizer updates: one `torch._foreach_lerp_` on the device (the
  first update copies them), no host sync. Parameters the optimizer does not update (frozen, PEFT's base) and buffers
  are not averaged: they are the same in both.
* During training, each `evaluate()` and `predict()` runs on the averaged weights (swapped in at
  `on_evaluate_begin` / `on_predict_begin`, back at `on_evaluate_end` / `on_predict_end`), so the metrics, and the best
  checkpoint chosen by them, are the average's. Outside `train()` the model is evaluated as it is.
* A checkpoint holds the training weights (the model files, as without averaging) and the averaged ones with the
  count of updates in this component's checkpointed state: tensors go to the stage-tensor safetensors file of each
  process (loopkit/checkpoint/stage_tensors.py), so a resumed run continues the same average bit for bit.
* At `on_train_end` (after the best checkpoint is loaded) the model takes the averaged weights: those of the best
  checkpoint with `load_best_model_at_end`, else the final average. So `train()` returns a model holding the
  weights that were evaluated and judged, as Lightning's `WeightAveraging` does at the end of fitting.

It is bound to the run like a stage (`bind(run, context)`, `state_dict()` / `load_state_dict()`) and hears events
after the stages and before the callbacks.
"""

from __future__ import annotations

import warnings

import torch

from .errors import config_error
from .stages.base import Stage
from .state import best_checkpoint_to_load

AVERAGING_KEY = "averaging"  # its entry among the checkpoint's stage states


def check_step_count(name: str, value, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise config_error(name, value, f"must be an integer of at least {minimum}", fix)


class WeightAveraging(Stage):
    """An average of the weights the optimizer updates; a subclass gives `update_weight`, the share the new weights
    get at each update."""

    def __init__(self, start_step: int = 0, every_n_steps: int = 1):
        check_step_count("start_step", start_step, 0, "pass the optimizer step after which averaging starts (0: "
                         "from the first step)")
        check_step_count("every_n_steps", every_n_steps, 1, "pass how many optimizer steps apart updates are "
                         "(1: every step)")
        self.start_step, self.every_n_steps = start_step, every_n_steps
        self.reset()

    def reset(self) -> None:
        self.updates = 0  # updates so far: the number of steps averaged
        self.names, self.params, self.averaged = [], [], []
        self.loaded = None  # averaged weights read from a checkpoint, by parameter name, until training begins
        self.in_train = False
        self.depth = 0  # nested evaluations (a callback's evaluate() inside one): the outermost one swaps
        self.swapped = False

    def bind(self, run, context) -> "WeightAveraging":
        if self.run is not None and self.run is not run:  # its events and checkpoints would mix two runs
            raise config_error("averaging", self, "this object already serves another Loop",
                               f"pass a new one to each Loop ({type(self).__name__}(...))")
        return super().bind(run, context)

    def update_weight(self, updates: int) -> float:
        """The share of the current weights in the average after update number `updates` + 1 (0 < share < 1)."""
        raise NotImplementedError

    # -- checkpointed state --
    def state_dict(self) -> dict:
        if self.updates == 0:
            return {"updates": 0}
        return {"updates": self.updates, "weights": dict(zip(self.names, self.averaged))}

    def load_state_dict(self, state: dict) -> None:
        """Each train(): {} for a fresh run (or a checkpoint written without averaging: the average starts at the
        next update); the checkpoint's entry when resuming."""
        self.reset()
        self.updates = state.get("updates", 0)
        self.loaded = saved_weights(state)

    # -- events --
    def on_init_end(self, args, state, control, **kwargs):
        refuse_sharded(self.context.accelerator)  # at construction: the engine is known once the Loop has built it

    def on_train_begin(self, args, state, control, **kwargs):
        """The parameters to average: those the optimizer updates, by the model's parameter names."""
        run = self.run
        updated = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
        named = [(name, p) for name, p in run.model.named_parameters() if id(p) in updated and p.is_floating_point()]
        self.names, self.params = [name for name, _ in named], [p for _, p in named]
        warn_if_low_precision(self)
        if self.loaded is not None:
            if set(self.loaded) != set(self.names):
                raise RuntimeError(f"The checkpoint's averaged weights are of other parameters than the ones the "
                                   f"optimizer updates ({sorted(set(self.loaded) ^ set(self.names))[:3]} differ). "
                                   f"Fix: resume with the model and trainable parameters that wrote it.")
            self.averaged = [self.loaded[name].to(device=p.device, dtype=p.dtype) for name, p in named]
            self.loaded = None
        else:
            self.averaged = [p.detach().clone() for p in self.params]  # overwritten by the first update
        self.in_train = True

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step <= self.start_step or (step - self.start_step) % self.every_n_steps:
            return
        with torch.no_grad():
            if self.updates == 0:
                torch._foreach_copy_(self.averaged, self.params)
            else:
                torch._foreach_lerp_(self.averaged, self.params, self.update_weight(self.updates))
        self.updates += 1

    def on_evaluate_begin(self, args, state, control, **kwargs):
        self.depth += 1
        if self.depth == 1 and self.in_train and self.updates > 0:
            self.swap()

    def on_evaluate_end(self, args, state, control, **kwargs):
        self.depth -= 1
        if self.depth == 0 and self.swapped:
            self.swap()

    on_predict_begin, on_predict_end = on_evaluate_begin, on_evaluate_end

    def on_train_end(self, args, state, control, **kwargs):
        """The model takes the averaged weights judged best (teardown has just loaded that checkpoint's training
        weights), or the final average."""
        self.in_train = False
        best_checkpoint = best_checkpoint_to_load(args, state)  # the one teardown has just loaded
        if best_checkpoint is not None:
            saved = self.context.checkpointer.read_stage_states(best_checkpoint).get(AVERAGING_KEY, {})
            best = saved_weights(saved)
            if best is None:
                return  # that checkpoint was evaluated on its training weights, which teardown loaded
            with torch.no_grad():
                torch._foreach_copy_(self.params, [best[name].to(p.device) for name, p in zip(self.names, self.params)])
        elif self.updates > 0:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.averaged)

    def on_train_failed(self, args, state, control, **kwargs):
        self.in_train = False

    def swap(self) -> None:
        """Exchange the model's weights with the averaged ones, a tensor at a time (one tensor's memory more)."""
        with torch.no_grad():
            for param, averaged in zip(self.params, self.averaged):
                held = param.detach().clone()
                param.copy_(averaged)
                averaged.copy_(held)
        self.swapped = not self.swapped


class EMA(WeightAveraging):
    """An exponential moving average: after each update, `average = decay * average + (1 - decay) * weights`; the
    first update copies the weights. `start_step` is the warm-up: the average begins after that optimizer step,
    so it does not carry the first steps' weights (timm's and TF's decay warm-up ramps the decay instead)."""

    def __init__(self, decay: float = 0.999, start_step: int = 0, every_n_steps: int = 1):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise config_error("decay", decay, "the share of the average kept at each update must lie strictly "
                               "between 0 and 1", "pass a value such as 0.999 (about the last 1,000 updates)")
        self.decay = float(decay)
        super().__init__(start_step, every_n_steps)

    def update_weight(self, updates: int) -> float:
        return 1.0 - self.decay

    def __repr__(self):
        return f"EMA(decay={self.decay}, start_step={self.start_step}, every_n_steps={self.every_n_steps})"


class SWA(WeightAveraging):
    """Stochastic weight averaging: the plain mean of the weights after each update (`AveragedModel`'s default)."""

    def update_weight(self, updates: int) -> float:
        return 1.0 / (updates + 1)

    def __repr__(self):
        return f"SWA(start_step={self.start_step}, every_n_steps={self.every_n_steps})"


def saved_weights(state: dict) -> dict | None:
    """The averaged weights of a checkpoint's entry by parameter name; None before the first update."""
    if not state.get("updates"):
        return None
    weights = state.get("weights") or {}
    missing = sorted(name for name, value in weights.items() if value is None) or ([] if weights else ["all"])
    if missing:
        raise RuntimeError(f"The checkpoint's averaged weights are missing for this process ({missing[:3]}): it was "
                           f"written by another number of processes, and each process keeps its own copy. Fix: "
                           f"resume with the number of processes that wrote it.")
    return weights


def averaged_weights(checkpoint: str, num_processes: int = 1, process_index: int = 0) -> dict | None:
    """The averaged weights a checkpoint folder holds, by parameter name (CPU tensors; None when it was saved before
    the first update), as the process `process_index` of `num_processes` wrote them: to deploy the average."""
    from .checkpoint.stage_tensors import read_stage_tensors, tensors_back

    own, tensors = read_stage_tensors(checkpoint, num_processes, process_index)
    return saved_weights(tensors_back(own, tensors).get(AVERAGING_KEY, {}))


def bind_averaging(averaging, run, context) -> "WeightAveraging | None":
    """`Loop(averaging=...)`: an `EMA`, an `SWA` (or another `WeightAveraging`) bound to this run, or None."""
    if averaging is None:
        return None
    if not isinstance(averaging, WeightAveraging):
        raise config_error("averaging", averaging, "is not a weight averaging",
                           "pass loopkit.EMA(decay=0.999) or loopkit.SWA(), or leave it out")
    return averaging.bind(run, context)


def refuse_sharded(accelerator) -> None:
    """The average is a full copy of each process's parameters: refused where they are sharded or engine-owned."""
    kind = str(getattr(accelerator, "distributed_type", ""))
    if "FSDP" in kind or "DEEPSPEED" in kind or getattr(accelerator, "is_fsdp2", False):
        raise config_error("averaging", "under " + kind.rsplit(".", 1)[-1], "weight averaging supports one process "
                           "and DDP, whose processes hold whole parameters", "train with DDP, or without averaging")


def warn_if_low_precision(averaging: WeightAveraging) -> None:
    """A 16-bit average loses updates smaller than its precision (bf16: 2**-8 of the value)."""
    low = sorted({str(p.dtype) for p in averaging.params if p.dtype in (torch.float16, torch.bfloat16)})
    if low:
        warnings.warn(f"averaging={averaging!r}: parameters in {', '.join(low)} are averaged in that dtype, which "
                      f"loses updates smaller than its precision. Keep float32 parameters (bf16=True trains with them "
                      f"under autocast) for an exact average.")


def warn_if_average_left_behind(averaging, saved: dict, checkpoint) -> None:
    """A resume without `averaging=` from a checkpoint that holds an average: say that it is not carried on."""
    if averaging is None and saved.get(AVERAGING_KEY, {}).get("updates"):
        warnings.warn(f"{checkpoint} holds averaged weights, and this Loop has no averaging=: they are left there, "
                      f"and the model trains on. Pass the run's averaging (averaging=EMA(...)) to go on with it.")
