"""The training script that tests/test_distributed.py launches with `torchrun` / `accelerate launch`, unchanged from a
one-process script: the same functions run in the pytest process for the one-process reference runs.

Usage (under a launcher): python dist_child.py OUT_DIR all | trap

* all: the scenarios below, one after the other in the same processes, each writing `<name>_rank<r>.json` (log
  history, metrics, ...) and `<name>_rank<r>.safetensors` (final weights) into OUT_DIR.
* trap: only builds a `Loop`; expects loopkit to refuse the launch (DistributedSetupError), writes the message to
  `trap_rank<r>.txt` and exits 3.

The model is a tiny Llama without dropout and the data causal-LM samples with a ragged number of label tokens, so the
loss normalisation by the token count summed across ranks matters. Each scenario is defined by its global batch:
2 processes x per-device batch b equals 1 process x batch 2b.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from loopkit import Loop, LoopArgs

TRAIN_SAMPLES, EVAL_SAMPLES, SEQ_LEN, VOCAB = 24, 13, 8, 64  # 13 eval samples: no even split over 2 x 3 or 6
MAX_STEPS, SAVE_AT = 8, 4


def lm_samples(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=g)
        labels = ids.clone()
        ignored = int(torch.randint(0, SEQ_LEN // 2, (1,), generator=g))
        if ignored:
            labels[-ignored:] = -100
        samples.append({"input_ids": ids, "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long), "labels": labels})
    return samples


class Stream(torch.utils.data.IterableDataset):
    """The samples in order, as a stream without length (each process reads it whole; Accelerate shards it)."""

    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                        attention_dropout=0.0))


def token_accuracy(prediction) -> dict:
    """compute_metrics on the gathered logits and labels (HF's path): next-token accuracy."""
    logits, labels = prediction.predictions, prediction.label_ids
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    counted = target != -100
    return {"gathered_accuracy": float(((predicted == target) & counted).sum() / counted.sum()),
            "gathered_samples": int(labels.shape[0])}


class SaveOnceAt(TrainerCallback):
    """One checkpoint, at `step` (save_strategy='no' otherwise): the run leaves exactly one checkpoint folder."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True


class SigtermAt(TrainerCallback):
    """A real SIGTERM to this process after optimizer step `step`, on one rank only."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and int(os.environ.get("RANK", "0")) == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def build_loop(output_dir: str, per_device_batch: int, *, accumulation: int = 1, sgd: bool = False,
               iterable: bool = False, callbacks=(), eval_batch: int | None = None) -> Loop:
    from loopkit.metrics import Perplexity, TokenAccuracy

    args = LoopArgs(output_dir=output_dir, max_steps=MAX_STEPS, per_device_train_batch_size=per_device_batch,
                    gradient_accumulation_steps=accumulation, per_device_eval_batch_size=eval_batch or 3,
                    learning_rate=3e-2 if sgd else 3e-3, warmup_steps=2, weight_decay=0.01, logging_steps=1,
                    save_strategy="no", optim="adamw_torch", disable_tqdm=True, seed=7,
                    include_num_input_tokens_seen="non_padding")
    optimizer = (torch.optim.SGD, {"lr": 3e-2, "momentum": 0.9}) if sgd else None
    train = lm_samples(TRAIN_SAMPLES, 1)
    return Loop(model=tiny_llama(), args=args, train_dataset=Stream(train) if iterable else train,
                eval_dataset=lm_samples(EVAL_SAMPLES, 2), compute_metrics=token_accuracy,
                metrics=[TokenAccuracy(), Perplexity()], callbacks=list(callbacks), optimizer_cls_and_kwargs=optimizer)


def write_result(out: str, name: str, loop: Loop, **extra) -> None:
    rank = loop.accelerator.process_index
    weights = {k: v.detach().cpu().contiguous() for k, v in loop.accelerator.unwrap_model(loop.model).state_dict()
               .items()}
    save_file(weights, os.path.join(out, f"{name}_rank{rank}.safetensors"))
    result = {"num_processes": loop.accelerator.num_processes, "global_step": loop.state.global_step,
              "log_history": loop.state.log_history, "num_input_tokens_seen": loop.state.num_input_tokens_seen,
              **extra}
    with open(os.path.join(out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


def run_training(out: str, name: str, per_device_batch: int, *, accumulation: int = 1, sgd: bool = False,
                 iterable: bool = False, eval_batch: int | None = None, save_at: int | None = None,
                 resume_from=None) -> Loop:
    """Evaluate the initial model, train, evaluate again; write the results. Returns the loop."""
    callbacks = [SaveOnceAt(save_at)] if save_at else []
    loop = build_loop(os.path.join(out, name), per_device_batch, accumulation=accumulation, sgd=sgd,
                      iterable=iterable, callbacks=callbacks, eval_batch=eval_batch)
    main_before_training = loop.state.is_world_process_zero  # decides who logs an evaluate() before train()
    before = loop.evaluate() if resume_from is None else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.train(resume_from_checkpoint=resume_from)
    after = loop.evaluate()
    write_result(out, name, loop, eval_before=before, eval_after=after, main_before_training=main_before_training,
                 warnings=[str(w.message) for w in caught])
    return loop


def run_preemption(out: str, per_device_batch: int) -> None:
    """SIGTERM to rank 1 only after step 3; with checks every 2 steps every rank must stop after step 4."""
    from loopkit.guards import Preempted

    loop = build_loop(os.path.join(out, "preempt"), per_device_batch, callbacks=[SigtermAt(3, rank=1)])
    loop.guard_check_every = 2
    code = None
    try:
        loop.train()
    except Preempted as stop:
        code = stop.code
    write_result(out, "preempt", loop, exit_code=code, signum=loop.preemption.signum)
    loop.accelerator.wait_for_everyone()  # both results are written before either process leaves


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "trap":
        from loopkit.distributed import DistributedSetupError

        try:
            build_loop(os.path.join(out, "trap"), 2)
        except DistributedSetupError as error:
            with open(os.path.join(out, f"trap_rank{os.environ.get('RANK', '0')}.txt"), "w") as f:
                f.write(str(error))
            sys.exit(3)
        sys.exit(0)  # trained nothing, but was not refused: the test fails on the missing file
    run_training(out, "adamw", 2, save_at=SAVE_AT)  # the run whose checkpoint the resumes start from
    run_training(out, "sgd", 1, accumulation=2, sgd=True)
    run_training(out, "iterable", 2, iterable=True)
    run_training(out, "resume", 2, resume_from=os.path.join(out, "adamw", f"checkpoint-{SAVE_AT}"))
    run_preemption(out, 2)
    leave()


def leave() -> None:
    """Every rank done, then exit without the interpreter's teardown. gloo's threads outlive
    destroy_process_group(), and one calling into Python while the interpreter finalizes aborts the process
    ("terminate called without an active exception") after all its work is written: seen in the two-node child
    under load and in dcp_child on a quiet machine (docs/distributed.md)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
