"""TRL's `SFTTrainer`, then `SFTLoop`, on each rank of a 2-process CPU launch (tests/test_trl_sft.py starts it as
`torchrun --nproc_per_node 2` would, forked ranks): the same arguments, reviews, tiny Llama and seed as the one-process
tests (`test_trl_sft.run`), a per-device batch of 2 with gradient accumulation 2, so 8 samples per optimizer step.

Usage: python trl_sft_ranks.py OUT_DIR  (writes <trl|loopkit>_rank<r>.json and .safetensors)
"""

from __future__ import annotations

import json
import os
import sys

from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the parity harness

from trl import SFTTrainer  # noqa: E402

from loopkit.trl import SFTLoop  # noqa: E402
from test_trl_sft import run  # noqa: E402

OPTIONS = dict(form="prompt-completion", n=32, per_device_train_batch_size=2, gradient_accumulation_steps=2,
               max_steps=4)


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    for name, trainer_class in (("trl", SFTTrainer), ("loopkit", SFTLoop)):
        result = run(trainer_class, os.path.join(out_dir, name), **OPTIONS)
        os.makedirs(out_dir, exist_ok=True)
        save_file({k: v.contiguous() for k, v in result["weights"].items()},
                  os.path.join(out_dir, f"{name}_rank{rank}.safetensors"))
        with open(os.path.join(out_dir, f"{name}_rank{rank}.json"), "w") as f:
            json.dump({"logs": result["logs"], "batches": result["batches"],
                       "processes": result["trainer"].accelerator.num_processes}, f)


if __name__ == "__main__":
    main(sys.argv[1])
