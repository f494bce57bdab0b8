"""How the data stage reads an epoch (`DataStage.windows` drives it): the epoch set on the loader and its sampler, the
micro-batches a resumed run already trained skipped as cheaply as the data allows (in the sampler, by the dataset's
own seek, or read and discarded), the checkpoint's RNG restored where the uninterrupted run stood, and a `ReadAhead`
over the loader, which reads one batch ahead as Accelerate's loader does (loopkit/data_order.py says why).

`get_resumed_dataloader` is HF's overridable hook (transformers 5.25); an override is called instead of loopkit's
own skipping. Keeps on the stage: nothing of its own (it reads `train_source`, `worker_seeding`, `length_order` and
`saved_order_rng`, which the loaders and the checkpointed state set).
"""

from __future__ import annotations

import warnings

from torch.utils.data import IterableDataset

from ..checkpoint import restore_rng_state
from ..data_order import PositionSeededDataset, ReadAhead, is_seekable
from .data_resume import ResumePoint


def set_epoch(loader, epoch: int) -> None:
    """Tell the loader (and Accelerate's seedable sampler inside it) which epoch starts: it fixes the order."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    inner = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(inner, "set_epoch"):
        inner.set_epoch(epoch)


class EpochReading:
    """The epoch-reading part of `DataStage` (a mixin): the epoch's `ReadAhead`, positioned for a resumed epoch."""

    def epoch_iterator(self, epoch: int, skip: int, resume: ResumePoint | None):
        """The epoch's micro-batches (a `ReadAhead`), positioned after the first `skip` (a resumed epoch; then the
        batch the interrupted run had read ahead, if stored, comes first), and the loader it reads. The
        checkpoint's RNG is restored exactly where the uninterrupted run stood."""
        if resume is not None and skip == 0 and resume.rng is not None:
            restore_rng_state(resume.rng)  # before the iterator: creating it draws from the RNG
        primed = resume.read_ahead if resume is not None else None
        loader = self.run.train_dataloader
        set_epoch(loader, epoch)
        if self.worker_seeding is not None:
            self.worker_seeding.epoch = epoch
        if self.length_order is not None and skip and self.saved_order_rng is not None:
            self.length_order.replay(self.saved_order_rng)  # the interrupted epoch's order, drawn again
        read = skip + (primed is not None)  # batches the interrupted run had read
        overridden = bool(read) and self.resumes_through_override()
        if overridden:  # HF's hook, overridden: told every batch the interrupted run read (its read-ahead too)
            loader, discard = self.get_resumed_dataloader(loader, read), 0
        else:
            loader, discard = self.skip_batches(loader, read, resume)
        dataset = getattr(loader, "dataset", None)
        if isinstance(dataset, PositionSeededDataset):
            dataset.start_epoch(epoch, read)
        # The plain loader, which ReadAhead reads ahead as Accelerate's shard would; an override's loader as returned.
        base = loader if overridden else getattr(loader, "base_dataloader", loader)
        iterator = iter(base)
        for _ in range(discard):
            next(iterator, None)
        if resume is not None and skip and resume.rng is not None:
            restore_rng_state(resume.rng)  # the checkpoint's RNG was taken after the batch read ahead
        return ReadAhead(iterator, primed, read_ahead=base is not loader), loader

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """HF's hook (transformers 5.25): the train loader past its first `num_batches` batches, for a resumed epoch.
        By default loopkit skips them itself (`skip_batches`: in the sampler, by the dataset's own seek, or by reading
        and discarding them); an override, for a stateful or streaming loader, is called instead, as in Trainer."""
        loader, discard = self.skip_batches(dataloader, num_batches, None)
        if discard:
            from accelerate import skip_first_batches

            return skip_first_batches(loader, discard)  # reads and discards them, as Trainer's default does
        return loader

    def resumes_through_override(self) -> bool:
        """Whether a `Loop` subclass or a stage subclass overrides `get_resumed_dataloader`."""
        return "get_resumed_dataloader" in vars(self) or \
            type(self).get_resumed_dataloader is not EpochReading.get_resumed_dataloader

    def skip_batches(self, loader, skip: int, resume: ResumePoint | None):
        """Skip the first `skip` micro-batches as cheaply as the data allows: in the sampler (map-style), by the
        dataset's own seek (an iterable with `load_state_dict`), or by reading and discarding them. Returns the
        loader to read and how many batches still have to be discarded."""
        source = self.train_source
        if not skip:
            return loader, 0
        if not isinstance(source, IterableDataset):
            from accelerate import skip_first_batches

            return skip_first_batches(loader, skip), 0  # skips indices in the sampler: nothing read or collated
        if resume is not None and resume.dataset_state is not None and is_seekable(source) and \
                self.run.args.dataloader_num_workers == 0:
            source.load_state_dict(resume.dataset_state)
            return loader, 0
        warnings.warn(f"Resuming mid-epoch on an iterable dataset that cannot seek: re-reading and discarding "
                      f"{skip} batches, which costs as much as reading them did. For an O(1) resume give the "
                      f"dataset state_dict()/load_state_dict() (datasets.IterableDataset has them) and use "
                      f"dataloader_num_workers=0.")
        return loader, skip
