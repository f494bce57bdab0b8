"""`GRPOLoop`: TRL's `GRPOTrainer` on loopkit's loop (docs/trl.md). `GRPOTrainer(` becomes `GRPOLoop(`.

A GRPO run is two stages of loopkit's, each swappable (`GRPOLoop(..., data=..., step=...)`):

    RolloutDataStage  the prompts in TRL's order (each prompt `num_generations` times, one generation batch repeated
                      for `steps_per_generation` micro-batches), and the rollouts: every `steps_per_generation`
                      micro-batches the current policy generates completions for a generation batch, the reward
                      functions score them and the rewards become group-normalised advantages (TRL's
                      `_generate_and_score_completions`); the result is shuffled, split into micro-batches and
                      handed out one micro-batch at a time, when the step stage reads it.
    GRPOStep          the policy update on those micro-batches: TRL's GRPO loss (`loss_type`, `beta`, `epsilon`
                      from `GRPOConfig`; TRL's `_compute_loss`), accumulation, clipping, optimizer.

Where TRL's `Trainer` subclass does this in `_get_train_sampler`, `get_train_dataloader` and `_prepare_inputs`
(called inside `training_step`), the rollouts here are the data stage's; a rollout happens at the same point of the
run as in TRL (inside the step, after `on_step_begin`, before the micro-batch's forward), so the random draws of the
generation are TRL's. The generation buffer and its position go into checkpoints (TRL keeps neither: a run resumed
between two generations regenerates, and trains on the new rollout's first micro-batch).
"""

from __future__ import annotations

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import RepeatSampler, shuffle_sequence_dict, split_pixel_values_by_grid, split_tensor_dict, \
    unsplit_pixel_values_by_grid

from ..data_order import batch_from_state, batch_state
from ..errors import config_error
from ..stages.data import DataStage
from ..stages.step import StepStage
from ..trainer.overridable import HFMethods
from .base import LoopKeywords, TRLLoop


class Rollouts:
    """The micro-batches of one window, each made when the step stage first reads it (`make(index, raw)`), as TRL
    makes it inside `training_step`: a generation's random draws then come where TRL's do."""

    def __init__(self, raw_batches: list, first_index: int, make):
        self.raw, self.first_index, self.make = raw_batches, first_index, make
        self.made = {}

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, i: int):
        if i not in self.made:
            self.made[i] = self.make(self.first_index + i, self.raw[i])
        return self.made[i]

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class RolloutDataStage(DataStage):
    """GRPO's data: prompts in TRL's repeat order, and the rollouts made from them (module docstring).

    `rollout(generation_batch) -> dict` makes one rollout: generation, rewards and advantages for a generation batch
    (a list of dataset rows), returning the tensors the step stage trains on (`prompt_ids`, `prompt_mask`,
    `completion_ids`, `completion_mask`, `advantages`, `num_items_in_batch`, and `old_per_token_logps` /
    `ref_per_token_logps` where TRL computes them). By default it is TRL's `_generate_and_score_completions`
    (`trl_rollout`, handed over by `GRPOLoop`); a subclass overrides `rollout` for other rollouts (calling
    `super().rollout(...)` to start from TRL's) and is passed as `GRPOLoop(..., data=YourStage())`."""

    trl_rollout = None  # TRL's rollout, bound to the loop (GRPOLoop sets it)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.buffer = None  # the micro-batches of the latest rollout (TRL's `_buffered_inputs`)

    def rollout(self, generation_batch: list) -> dict:
        return self.trl_rollout(generation_batch)

    # -- TRL's batch arithmetic --
    @property
    def steps_per_generation(self) -> int:
        return self.run.args.steps_per_generation

    @property
    def generate_every(self) -> int:
        """Micro-batches between two generations: a generation serves `steps_per_generation` micro-batches,
        `num_iterations` times over."""
        return self.run.args.steps_per_generation * self.run.args.num_iterations

    def get_train_dataloader(self):
        """A loader batch is a whole generation batch: `steps_per_generation` micro-batches' prompts (TRL's)."""
        run = self.run
        if run.train_dataset is None:
            raise config_error("train_dataset", None, "training needs a train dataset", "pass train_dataset=...")
        return self.build_dataloader(run.train_dataset, self.train_batch_size() * self.steps_per_generation,
                                     "training", True)

    def train_sampler(self, dataset):
        """TRL's `RepeatSampler`: each prompt `num_generations` times in a generation batch, the generation batch
        repeated for each micro-batch it serves (see `GRPOTrainer._get_train_sampler`)."""
        args = self.run.args
        return RepeatSampler(data_source=dataset, mini_repeat_count=args.num_generations,
                             batch_size=args.generation_batch_size // args.num_generations,
                             repeat_count=self.generate_every, shuffle=args.shuffle_dataset, seed=args.seed)

    def eval_sampler(self, dataset):
        args = self.run.args
        return RepeatSampler(data_source=dataset, mini_repeat_count=args.num_generations_eval or args.num_generations,
                             seed=args.seed)

    # -- the rollouts, micro-batch by micro-batch --
    def windows(self, epoch, plan, resume):
        for window in super().windows(epoch, plan, resume):
            window.batches = Rollouts(window.batches, window.first_index, self.micro_batch)
            yield window

    def micro_batch(self, index: int, generation_batch: list) -> dict:
        """Micro-batch `index` of the epoch: from a new rollout at each `generate_every`-th micro-batch (or when no
        rollout is buffered), else from the buffered one (TRL's `_prepare_inputs`)."""
        if index % self.generate_every == 0 or self.buffer is None:
            self.run.model.train()  # TRL's rollout reads the mode ("train"), set by training_step before it
            rollout = shuffle_sequence_dict(split_pixel_values_by_grid(self.rollout(generation_batch)))
            self.buffer = [unsplit_pixel_values_by_grid(part)
                           for part in split_tensor_dict(rollout, self.steps_per_generation)]
        return self.buffer[index % self.steps_per_generation]

    # -- checkpoints: the buffer too (TRL regenerates on resume) --
    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.buffer is not None:
            stored = batch_state(self.buffer)
            if stored is not None:
                state["rollout_buffer"] = stored
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        stored = (state or {}).get("rollout_buffer")
        self.buffer = batch_from_state(stored) if stored is not None else None


class GRPOStep(StepStage):
    """GRPO's policy update: TRL's loss on the rollouts' micro-batches, then loopkit's accumulation, clipping and
    optimizer step.

    `compute_loss(model, inputs)` is TRL's `_compute_loss` (`trl_loss`, handed over by `GRPOLoop`: the loss of
    `GRPOConfig.loss_type` with its `beta`, `epsilon`, `epsilon_high`, ..., normalised over the window as TRL does,
    its metrics logged as TRL logs them). A subclass overrides `compute_loss` for another loss on the same
    `inputs` (`RolloutDataStage` lists them) and is passed as `GRPOLoop(..., step=YourStep())`."""

    loss_is_scaled_for_ga = True  # TRL's losses divide by the window themselves
    trl_loss = None  # TRL's loss, bound to the loop (GRPOLoop sets it)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The GRPO loss has no outputs to return (as GRPOTrainer)")
        return self.trl_loss(model, inputs)

    def count_loss_items(self, batches):
        return None  # the rollout counts them (`num_items_in_batch` in each micro-batch)


class GRPOLoop(LoopKeywords, GRPOTrainer, TRLLoop):
    """TRL's `GRPOTrainer`: its arguments, rollouts and loss; loopkit's run with the rollouts as the data stage and
    the update as the step stage (module docstring). `data=` / `step=` swap either (a `RolloutDataStage` /
    `GRPOStep` subclass)."""

    args_class = GRPOConfig  # the config whose fields this loop honours (loopkit/args/checks.py)
    stage_classes = {**TRLLoop.stage_classes, "data": RolloutDataStage, "step": GRPOStep}
    stage_hooks = {"rollout": "data"}  # a rollout variant is a RolloutDataStage subclass (loopkit/trl/base.py)
    # The loader, the sampler and the loss are the stages' (above), not GRPOTrainer's overrides of Trainer's.
    get_train_dataloader = HFMethods.get_train_dataloader
    get_eval_dataloader = HFMethods.get_eval_dataloader
    compute_loss = HFMethods.compute_loss

    @property
    def current_gradient_accumulation_steps(self) -> int:
        """Micro-batches in the current window (HF's attribute; TRL's loss divides by it): the step stage's."""
        return self.step.current_gradient_accumulation_steps

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for hook, instead in (("_prepare_inputs", "RolloutDataStage.micro_batch"),
                              ("_get_train_sampler", "RolloutDataStage.train_sampler")):
            if getattr(cls, hook) is not getattr(GRPOTrainer, hook):
                raise TypeError(f"{cls.__name__} overrides GRPOTrainer.{hook}, which GRPOLoop's training does not "
                                f"call, so the override would change nothing. Override {instead} instead and pass "
                                f"data=YourStage().")

    def __init__(self, *args, **kwargs):
        train_dataset = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        if isinstance(train_dataset, torch.utils.data.IterableDataset) or type(train_dataset).__name__ == \
                "IterableDataset":  # TRL reorders a stream with repeat_iterable_dataset: not done here yet
            raise config_error("train_dataset", type(train_dataset).__name__, "GRPOLoop repeats prompts with TRL's "
                               "RepeatSampler, which needs a dataset with a length",
                               "pass a datasets.Dataset (e.g. Dataset.from_list(list(stream.take(n))))")
        super().__init__(*args, **kwargs)
        self.data.trl_rollout = self._generate_and_score_completions
        self.step.trl_loss = self._compute_loss
