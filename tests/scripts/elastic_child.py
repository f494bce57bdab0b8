"""The training script of tests/test_elastic.py: a tiny Llama on causal-LM samples, DDP, a save every 2 steps,
`resume_from_checkpoint="auto"`, run under `torchrun --max-restarts N --rdzv-backend c10d`.

Usage: python elastic_child.py OUTPUT_DIR STORAGE [KILL]

STORAGE: `hf` (HFStorage, synchronous saves) or `dcp-async` (DCPStorage(async_save=True): the writer thread and its
gloo group).

KILL, `RANK:STEP:MOMENT`, SIGKILLs rank RANK in the first attempt only (TORCHELASTIC_RESTART_COUNT=0) at MOMENT of
optimizer step STEP: `step` (at on_step_end, before that step's save), `save` (inside the save of checkpoint-STEP:
this rank's RNG file written, the folder not yet renamed), `saved` (right after the rename, before on_save) or `substep`
(inside the accumulation window of step STEP, after its first micro-batch). `sigterm` sends SIGTERM to rank RANK's
torchrun agent (the job's launcher) at on_step_end of STEP instead; `stall` (STEP 0) keeps rank RANK from joining
the process group for 3 x DDP_TIMEOUT_S, as a hung rendezvous would (the other rank's init gives up at its
ddp_timeout, STALLED_ATTEMPT_TIMEOUT_S in that attempt). Rank 0 writes OUTPUT_DIR/final.safetensors at
the end and each rank OUTPUT_DIR/rank<r>.json (the steps it ran in each attempt, its exit code if preempted).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from safetensors.torch import save_file
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import lm_data, tiny_llama  # noqa: E402

import loopkit.checkpoint as ckpt  # noqa: E402
from loopkit import Loop, LoopArgs  # noqa: E402
from loopkit.storage import DCPStorage, HFStorage  # noqa: E402

STORAGES = {"hf": HFStorage, "dcp-async": lambda: DCPStorage(async_save=True)}

MAX_STEPS, SAVE_STEPS = 8, 2
DDP_TIMEOUT_S = 60  # ddp_timeout: the process group's timeout, its init's included
# The stalled job's first attempt: its only wait is the init that the stalled rank never joins, so a shorter
# ddp_timeout ends it sooner (the suite's time) and proves the same restart; its later attempts use DDP_TIMEOUT_S.
STALLED_ATTEMPT_TIMEOUT_S = 15
RANK, ATTEMPT = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Kill(TrainerCallback):
    """SIGKILL (or the launcher's SIGTERM) at the chosen moment of the chosen step, in the first attempt."""

    def __init__(self, spec: str | None):
        rank, step, self.moment = spec.split(":") if spec else ("-1", "-1", "")
        self.armed = ATTEMPT == 0 and int(rank) == RANK
        self.step, self.signalled_at = int(step), None
        if self.armed and self.moment == "save":
            self.wrap_save_state_file()

    def wrap_save_state_file(self) -> None:
        """Die right after this process wrote its RNG file into checkpoint-STEP's folder (every process writes one;
        the folder is not renamed yet)."""
        original = ckpt.save_state_file

        def save_state_file(state, path):
            original(state, path)
            if os.path.basename(path).startswith("rng_state") and f"checkpoint-{self.step}" in path:
                die()

        ckpt.save_state_file = save_state_file

    def on_substep_end(self, args, state, control, **kwargs):
        if self.armed and self.moment == "substep" and state.global_step == self.step - 1:
            die()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.armed or state.global_step != self.step:
            return
        if self.moment == "step":
            die()
        if self.moment == "sigterm":
            self.signalled_at = time.time()
            os.kill(os.getppid(), signal.SIGTERM)  # the torchrun agent: it forwards SIGTERM to every worker

    def on_save(self, args, state, control, **kwargs):
        if self.armed and self.moment == "saved" and state.global_step == self.step:
            die()


class Steps(TrainerCallback):
    """The steps this process ran, and the number of steps done when a SIGTERM reached it (loopkit's handler is
    wrapped once train() has installed it). At the start of training it writes the attempt's record, which the end
    of main() completes: a rank the launcher's SIGTERM ends at once (its train() had already raised when a peer
    died, and restored the default handler) still leaves its attempt on record."""

    def __init__(self, out: str):
        self.steps, self.signal_after_step, self.out = [], None, out

    def on_train_begin(self, args, state, control, **kwargs):
        write_record(self.out, {"attempt": ATTEMPT, "steps": []})
        handler = signal.getsignal(signal.SIGTERM)

        def noted(signum, frame):
            if self.signal_after_step is None:
                self.signal_after_step = state.global_step
            handler(signum, frame)

        signal.signal(signal.SIGTERM, noted)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def write_record(out: str, record: dict) -> None:
    with open(os.path.join(out, f"rank{RANK}-attempt{ATTEMPT}.json"), "w") as f:
        json.dump(record, f)


def main() -> None:
    out, storage, spec = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else None)
    steps, kill = Steps(out), Kill(spec)
    stalled_attempt = ATTEMPT == 0 and spec is not None and spec.endswith(":stall")
    if kill.armed and kill.moment == "stall":
        time.sleep(3 * DDP_TIMEOUT_S)
    args = LoopArgs(output_dir=os.path.join(out, "run"), max_steps=MAX_STEPS, per_device_train_batch_size=2,
                    gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=2, weight_decay=0.01,
                    logging_steps=1, save_steps=SAVE_STEPS, optim="adamw_torch", disable_tqdm=True, seed=7,
                    report_to="none",
                    ddp_timeout=STALLED_ATTEMPT_TIMEOUT_S if stalled_attempt else DDP_TIMEOUT_S)
    loop = Loop(model=tiny_llama(), args=args, train_dataset=lm_data(64), callbacks=[kill, steps],
                storage=STORAGES[storage]())
    record = {"attempt": ATTEMPT, "steps": steps.steps}
    try:
        loop.train(resume_from_checkpoint="auto")
    except SystemExit as stop:
        record.update(exit_code=stop.code, signal_after_step=steps.signal_after_step, left_at=time.time(),
                      signalled_at=kill.signalled_at)
        raise
    finally:
        write_record(out, record)
    if RANK == 0:
        weights = {k: v.detach().contiguous() for k, v in loop.accelerator.unwrap_model(loop.model).state_dict().items()}
        save_file(weights, os.path.join(out, "final.safetensors"))


if __name__ == "__main__":
    main()
