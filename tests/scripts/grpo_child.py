"""One rank of a 2-process GRPO run (tests/test_trl_grpo.py::test_two_processes_match_trl): GRPOTrainer or GRPOLoop
by argv[2] on a tiny Llama saved at argv[3], writing rank 0's log history and final weights to argv[1]."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from safetensors.torch import save_file  # noqa: E402

import test_trl_grpo as grpo  # noqa: E402


def main(out: str, which: str, model_path: str) -> None:
    from trl import GRPOTrainer

    from loopkit.trl import GRPOLoop

    trainer_class = GRPOLoop if which == "loopkit" else GRPOTrainer
    logs, record, weights = grpo.train(trainer_class, model_path, os.path.join(out, which), max_steps=2,
                                       gradient_accumulation_steps=2, beta=0.04, ddp_backend="gloo")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, f"{which}.json"), "w") as f:
            json.dump({"log_history": logs, "record": record}, f)
        save_file({name: value.contiguous() for name, value in weights.items()}, os.path.join(out, f"{which}.safetensors"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
