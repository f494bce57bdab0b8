"""`PackingDataStage`: a data stage whose training loader serves rows of packed samples (loopkit/row_packing.py says
how rows are packed and why the result is exact); evaluation does not pack."""

from __future__ import annotations

from torch.utils.data import IterableDataset

from ..errors import config_error
from ..row_packing import (PackedBatchCollator, PackedStream, check_packing_is_exact, collate_packed_rows, pack_samples,
                       packed_row)
from .data import DataStage


class PackingDataStage(DataStage):
    """`DataStage` whose training loader serves packed rows (loopkit/row_packing.py); evaluation does not pack.

    `pack="dataset"` packs across the whole dataset (fewest rows), `pack="batch"` within each batch of
    `per_device_train_batch_size` samples (the padded run's samples per step). `tolerance` bounds the setup check.
    """

    def __init__(self, row_tokens: int = 512, pad_id: int = 0, pack: str = "dataset", tolerance: float = 1e-5):
        super().__init__()
        if pack not in ("dataset", "batch"):
            raise config_error("pack", pack, "packing is across the dataset or within each batch",
                               "pass pack='dataset' or pack='batch'")
        if not isinstance(row_tokens, int) or row_tokens < 2:
            raise config_error("row_tokens", row_tokens, "a row holds a whole number of tokens, at least 2",
                               "pass the row length in tokens, e.g. the model's context length")
        self.row_tokens, self.pad_id, self.pack, self.tolerance = row_tokens, pad_id, pack, tolerance
        self.rows = None

    def get_train_dataloader(self):
        run = self.run
        if run.train_dataset is None:
            raise config_error("train_dataset", None, "training needs a train dataset", "pass train_dataset=...")
        check_packing_is_exact(run.model, self.tolerance)
        batch_size, samples = run.args.per_device_train_batch_size, run.train_dataset
        if self.pack == "batch":
            collator = PackedBatchCollator(self.row_tokens, self.pad_id)
            return self.build_dataloader(samples, batch_size, "training", True, collator=collator)
        if isinstance(samples, IterableDataset):
            rows = PackedStream(samples, self.row_tokens, self.pad_id)
        else:
            rows = self.rows = [packed_row(samples, indices, self.row_tokens, self.pad_id)
                                for indices in pack_samples(samples, self.row_tokens)]
        return self.build_dataloader(rows, batch_size, "training", True, collator=collate_packed_rows)
