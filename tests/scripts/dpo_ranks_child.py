"""The 2-rank launch of tests/test_trl_dpo.py: on each rank, TRL's DPOTrainer and then DPOLoop train the same DPO run
(reference log-probs precomputed over the dataset by each, then the sigmoid loss), one after the other in the same
processes. Each writes `<trainer>_rank<r>.json` (its log history) and `<trainer>_rank<r>.safetensors` (its final
weights) into OUT_DIR.

Usage (under a launcher, CPU, gloo): python dpo_ranks_child.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist
from accelerate import PartialState
from datasets import load_from_disk
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the test's own helpers
from test_trl_dpo import DPOLoop, DPOTrainer, review_pairs, train  # noqa: E402

PAIRS = 14  # the precompute's last batch is uneven over 2 ranks x 4 (gather_for_metrics drops the repeated rows)


def pairs_on_disk(out: str):
    """The pairs saved by rank 0 and read by every rank: TRL's precompute writes the column to a cache file next to
    the dataset's, which each rank then reads (an in-memory dataset's cache goes to a per-process temporary folder,
    where rank 1 does not find rank 0's file, with either trainer)."""
    folder = os.path.join(out, "pairs")
    state = PartialState(cpu=True)  # without cpu=True, Accelerate on a machine without a GPU sees one process per rank
    if state.is_main_process:
        review_pairs(PAIRS).save_to_disk(folder)
    state.wait_for_everyone()
    return load_from_disk(folder)


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    data = pairs_on_disk(out)
    for cls in (DPOTrainer, DPOLoop):
        trainer = train(cls, os.path.join(out, cls.__name__), data, "precompute", max_steps=3,
                        per_device_train_batch_size=2, precompute_ref_log_probs=True, precompute_ref_batch_size=4)
        with open(os.path.join(out, f"{cls.__name__}_rank{rank}.json"), "w") as f:
            json.dump({"log_history": trainer.state.log_history,
                       "ref_logps": list(trainer.train_dataset["ref_chosen_logps"])}, f)
        save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()},
                  os.path.join(out, f"{cls.__name__}_rank{rank}.safetensors"))
        dist.barrier()
        if rank == 0:  # TRL caches the column by fingerprint: the next trainer computes its own
            for cache in trainer.train_dataset.cache_files:
                os.remove(cache["filename"])
        dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
