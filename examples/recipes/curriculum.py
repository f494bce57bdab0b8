"""Recipe 10: curriculum learning: switch the training data distribution every N epochs from a hook.

Phases of real Rotten Tomatoes reviews by difficulty (length in words as the proxy): phase 0 trains on short
reviews only, phase 1 on short and medium ones, phase 2 on all of them. Every `epochs_per_phase` epochs the next
phase begins.

`CurriculumDataset` keeps the same length in every phase (index `i` maps into the current phase's pool), so the
loop's step and epoch arithmetic, computed once at the start, stays right; the sampler still shuffles each epoch.
The switch must happen before the epoch's first batch is read: `on_epoch_begin` is that point. (With
`dataloader_num_workers > 0` and persistent workers, the workers hold a copy of the dataset: use workers that
restart each epoch, the default.)

Two styles:
* callback: `CurriculumSwitch(dataset, epochs_per_phase)` sets the phase in `on_epoch_begin`.
* stage subclass: `CurriculumData(DataStage)` sets it in `windows()`, the data stage's method that yields an
  epoch's batches, so the data stage owns the data's schedule: `Loop(..., data=CurriculumData(...))`.
Both read the epoch number the loop is about to run, so a resumed run resumes in the right phase.
"""

from __future__ import annotations

import dataclasses
import math

from torch.utils.data import Dataset

from common import ReviewDataset, Size, accuracy, cli, load_classifier, loop_args, output_folder, review_split
from loopkit import DataStage, Loop


class CurriculumDataset(Dataset):
    """A fixed-length view onto the current phase's pool; records which phase served each item."""

    def __init__(self, pools: list[ReviewDataset], length: int):
        self.pools, self.length, self.phase = pools, length, 0
        self.served_phases = []  # the phase of every item read (what the tests check)

    def set_phase(self, phase: int) -> None:
        self.phase = min(phase, len(self.pools) - 1)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        pool = self.pools[self.phase]
        self.served_phases.append(self.phase)
        return pool[index % len(pool)]


def phase_of(epoch: int, epochs_per_phase: int) -> int:
    return epoch // epochs_per_phase


class CurriculumSwitch:
    """Callback style."""

    def __init__(self, dataset: CurriculumDataset, epochs_per_phase: int):
        self.dataset, self.epochs_per_phase = dataset, epochs_per_phase

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.dataset.set_phase(phase_of(math.floor(state.epoch + 1e-9), self.epochs_per_phase))


class CurriculumData(DataStage):
    """Stage style: the data stage picks the phase as it starts each epoch."""

    def __init__(self, dataset: CurriculumDataset, epochs_per_phase: int):
        super().__init__()
        self.dataset, self.epochs_per_phase = dataset, epochs_per_phase

    def windows(self, epoch, plan, resume):
        self.dataset.set_phase(phase_of(epoch, self.epochs_per_phase))
        yield from super().windows(epoch, plan, resume)


def curriculum_pools(size: Size, phases: int = 3):
    """Phase k holds the shortest (k + 1) / phases of the training reviews."""
    train_rows, eval_rows = review_split(size.n_train, size.n_eval)
    by_length = sorted(train_rows, key=lambda row: len(row[0].split()))
    pools = [ReviewDataset(by_length[:len(by_length) * (k + 1) // phases], size.max_length) for k in range(phases)]
    return CurriculumDataset(pools, len(train_rows)), ReviewDataset(eval_rows, size.max_length)


def main(tiny: bool = False, output_dir: str | None = None, style: str = "stage", epochs_per_phase: int = 1,
         phases: int = 3):
    size = Size.pick(tiny)
    if not tiny:  # three epochs: a smaller slice of the reviews keeps the default run near a minute on 2 cores
        size = dataclasses.replace(size, n_train=384)
    train, evaluation = curriculum_pools(size, phases)
    if style == "stage":
        extra = dict(data=CurriculumData(train, epochs_per_phase))
    else:
        extra = dict(callbacks=[CurriculumSwitch(train, epochs_per_phase)])
    args = loop_args(output_folder(output_dir, "curriculum"), size, num_train_epochs=phases * epochs_per_phase,
                     eval_strategy="epoch")
    loop = Loop(model=load_classifier(size), args=args, train_dataset=train, eval_dataset=evaluation,
                compute_metrics=accuracy, **extra)
    loop.train()
    per_epoch = len(train.served_phases) // (phases * epochs_per_phase)
    for epoch in range(phases * epochs_per_phase):
        served = set(train.served_phases[epoch * per_epoch:(epoch + 1) * per_epoch])
        print(f"epoch {epoch}: trained on phase {sorted(served)}")
    return loop, train


if __name__ == "__main__":
    cli(main, __doc__)
