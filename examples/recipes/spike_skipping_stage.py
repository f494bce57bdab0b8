"""Recipe 12: swapping a whole stage: a step stage that skips the update of any step whose gradient norm spikes.

`Loop(..., step=SpikeSkippingStep())` replaces the step stage. Everything else (events, clipping, logging,
checkpoints) is inherited; the one change is in `clip_gradients`, which the step stage calls between the last
backward and `optimizer.step()` and which returns the pre-clip gradient norm:

* a step is a spike when its norm exceeds `factor` times the median norm of the last `window` normal steps (after
  `min_history` of them); spikes do not enter the history, so one spike does not raise the bar for the next;
* on a spike the gradients are dropped (`zero_grad(set_to_none=True)`): AdamW skips parameters without a gradient,
  so the weights, the moments and the weight decay are all untouched. The step still counts (`global_step`, the LR
  schedule and the logs, whose `grad_norm` shows the spike), like an fp16 step skipped on overflow.

Cost: deciding needs the norm on the host, one `.item()` per step (the default stage keeps the norm on the device
until a log). On a CPU it is free; on a GPU it is one sync per step.

Why a stage and not a callback: a callback can observe the gradients (`on_gradients_ready`,
`on_pre_optimizer_step`) but cannot veto `optimizer.step()`; zeroing the gradients is not a skip either, since AdamW
still moves the weights along its momentum and applies weight decay.

The demo multiplies one step's loss by 1000 (`WithInjectedSpikes`), standing in for a corrupted batch.
"""

from __future__ import annotations

import statistics
from collections import deque

from common import Size, accuracy, cli, load_classifier, loop_args, output_folder, review_datasets
from loopkit import Loop, StepStage


class SpikeSkippingStep(StepStage):
    def __init__(self, factor: float = 5.0, window: int = 20, min_history: int = 3):
        super().__init__()
        self.factor, self.min_history = factor, min_history
        self.recent_norms = deque(maxlen=window)
        self.skipped_steps = []

    def clip_gradients(self, model):
        norm = super().clip_gradients(model)  # the pre-clip norm (the gradients are clipped in place)
        value = float(norm)  # host control flow below needs the value: one sync per step
        if len(self.recent_norms) >= self.min_history and value > self.factor * statistics.median(self.recent_norms):
            self.skipped_steps.append(self.run.state.global_step + 1)  # the step being completed
            model.zero_grad(set_to_none=True)  # no gradient: the optimizer leaves every parameter as it is
        else:
            self.recent_norms.append(value)
        return norm


class WithInjectedSpikes(SpikeSkippingStep):
    """For the demo and the tests: the loss of the given optimizer steps is multiplied by `scale`."""

    def __init__(self, spike_steps=(), scale: float = 1000.0, **kwargs):
        super().__init__(**kwargs)
        self.spike_steps, self.scale = set(spike_steps), scale

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.run.state.global_step + 1 not in self.spike_steps or not model.training:
            return result
        return (result[0] * self.scale, result[1]) if return_outputs else result * self.scale


def main(tiny: bool = False, output_dir: str | None = None, spike_steps=None, max_steps: int = -1,
         step: StepStage | None = None, callbacks=()):
    size = Size.pick(tiny)
    train, evaluation = review_datasets(size)
    spike_steps = spike_steps if spike_steps is not None else ((5,) if tiny else (30,))
    step = step or WithInjectedSpikes(spike_steps)
    args = loop_args(output_folder(output_dir, "spikes"), size, max_steps=max_steps, logging_steps=1 if tiny else 5)
    loop = Loop(model=load_classifier(size), args=args, train_dataset=train, eval_dataset=evaluation,
                compute_metrics=accuracy, step=step, callbacks=list(callbacks))
    loop.train()
    loop.evaluate()  # printed by the loop's log printer
    print(f"spikes injected at steps {sorted(spike_steps)}; updates skipped at steps "
          f"{getattr(step, 'skipped_steps', None)}")
    return loop, step


if __name__ == "__main__":
    cli(main, __doc__)
