"""Accelerate's record of the train loader being read (its `GradientState`: the active loader, `end_of_dataloader`,
`remainder`), kept as a prepared loader keeps it when iterated itself, although the data stage reads the plain loader
under it (one batch ahead, loopkit/data_order.py). So `accelerator.gather_for_metrics` in a `compute_loss` (TRL's
metrics) drops the samples Accelerate repeated to fill the epoch's last batch on several processes, as under
Trainer. `DataStage.windows` sets the loader's `end_of_dataloader` once the epoch's last batch is read; the record
ends with the training (`release_train_loader`, at `on_train_end` / `on_train_failed`). Flags on the host: no sync.
"""

from __future__ import annotations

from ..data_order import ReadAhead


class EndOfLoaderTracking:
    """The end-of-loader part of `DataStage` (a mixin): keeps `tracked_loader`, the loader Accelerate holds active."""

    def track_end_of_loader(self, loader, reader: ReadAhead):
        """Make `loader` Accelerate's active loader for the epoch, as a prepared loader does when iterated itself
        (`DataLoaderShard.begin`: `remainder`, the real samples of the last batch across processes); `windows` sets
        its `end_of_dataloader` once the epoch's last batch is read, before that window's first forward, as Trainer
        reads it. Returns the loader, or None where the loader keeps the record itself (iterated as it is: a plain
        `DataLoader`, or one a `get_resumed_dataloader` override returned). Flags on the host: no device sync."""
        from accelerate.data_loader import DataLoaderStateMixin

        self.release_train_loader()
        if not reader.read_ahead or not isinstance(loader, DataLoaderStateMixin):
            return None
        loader.begin()
        self.tracked_loader = loader
        return loader

    def release_train_loader(self) -> None:
        """Accelerate's record of the train loader ends with the training (Trainer's goes with its train())."""
        if self.tracked_loader is not None:
            self.tracked_loader.end()
            self.tracked_loader = None
