"""A training process the checkpoint tests kill, signal and resume.

Usage: python train_child.py OUTPUT_DIR [MOMENT [OCCURRENCE]]

It trains a tiny Llama with dropout and a collator that draws random numbers, saving every 2 optimizer steps, and
resumes from the newest usable checkpoint in OUTPUT_DIR if there is one. MOMENT names where the process dies:
a SIGKILL at the OCCURRENCE-th time it reaches that moment (inside a phase of a save, inside an accumulation window,
during evaluation), or "sigterm-step" / "sigterm-eval" for a real SIGTERM to itself (preemption). Without MOMENT it
runs to the end and writes the final weights to OUTPUT_DIR/final.safetensors.
"""

import os
import shutil
import signal
import sys

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

import loopkit.checkpoint as ckpt
from loopkit import Loop, LoopArgs

MAX_STEPS = 40


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Moment:
    """Counts arrivals at one named moment and kills the process at the chosen one."""

    def __init__(self, name, occurrence):
        self.name, self.occurrence, self.seen = name, occurrence, 0

    def reached(self, name) -> bool:
        if name != self.name:
            return False
        self.seen += 1
        return self.seen == self.occurrence


def truncate_and_die(path):
    if os.path.isfile(path):
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    die()


def install(moment: Moment) -> list:
    """Patch the writer so the process dies inside the named phase of a save. Returns extra callbacks."""
    original_model_files, original_save = ckpt.save_model_files, torch.save
    original_write_text, original_fsync = ckpt.write_text, ckpt.fsync_tree
    original_replace, original_rmtree = os.replace, shutil.rmtree

    def model_files(model, accelerator, output_dir, *args, **kwargs):
        original_model_files(model, accelerator, output_dir, *args, **kwargs)
        if moment.reached("weights"):
            truncate_and_die(os.path.join(output_dir, "model.safetensors"))

    def torch_save(obj, f, *args, **kwargs):
        original_save(obj, f, *args, **kwargs)
        path = getattr(f, "name", f)  # a path, or the open file loopkit's state files are written to
        name = os.path.basename(str(path)).split(".")[0].split("_state")[0]  # optimizer / scheduler / rng
        if moment.reached(name):
            if hasattr(f, "flush"):
                f.flush()
            truncate_and_die(path)

    def write_text(path, text):
        original_write_text(path, text)
        if moment.reached(os.path.basename(path).split(".")[0]):  # trainer_state / loopkit_state
            truncate_and_die(path)

    def fsync_tree(path):
        if moment.reached("fsync"):
            die()
        original_fsync(path)

    def replace(src, dst, *args, **kwargs):
        if os.path.basename(str(src)).startswith(".tmp-checkpoint") and moment.reached("rename"):
            die()
        return original_replace(src, dst, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        if os.path.basename(str(path)).startswith(".deleting-checkpoint") and moment.reached("rotate"):
            os.remove(os.path.join(path, "model.safetensors"))  # half deleted, then killed
            die()
        return original_rmtree(path, *args, **kwargs)

    ckpt.save_model_files, ckpt.write_text, ckpt.fsync_tree = model_files, write_text, fsync_tree
    torch.save, os.replace, shutil.rmtree = torch_save, replace, rmtree

    class KillInTraining(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            if moment.reached("substep"):
                die()

        def on_step_end(self, args, state, control, **kwargs):
            if moment.reached("sigterm-step"):
                os.kill(os.getpid(), signal.SIGTERM)

        def on_prediction_step(self, args, state, control, **kwargs):
            if moment.reached("evaluate"):
                die()
            if moment.reached("sigterm-eval"):
                os.kill(os.getpid(), signal.SIGTERM)

    return [KillInTraining()]


def masking_collator(features):
    """Stacks token ids and hides a random 20% of the labels: a collator that draws from the global RNG."""
    ids = torch.stack([torch.as_tensor(f["input_ids"]) for f in features])
    labels = ids.clone()
    labels[torch.rand(labels.shape) < 0.2] = -100
    return {"input_ids": ids, "labels": labels}


def main():
    out = sys.argv[1]
    moment = Moment(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1) if len(sys.argv) > 2 else None
    callbacks = install(moment) if moment else []
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (16,), generator=g)} for _ in range(40)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.1,
                                         max_position_embeddings=32))
    args = LoopArgs(output_dir=out, max_steps=MAX_STEPS, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                    learning_rate=3e-3, warmup_steps=3, weight_decay=0.01, logging_steps=1, save_steps=2,
                    save_total_limit=3, eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=2,
                    remove_unused_columns=False, disable_tqdm=True, seed=11)
    loop = Loop(model=model, args=args, train_dataset=data, eval_dataset=data[:6], data_collator=masking_collator,
                callbacks=callbacks)
    resume = True if ckpt.last_checkpoint(out) else None
    loop.train(resume_from_checkpoint=resume)
    save_file({k: v.contiguous() for k, v in loop.model.state_dict().items()}, os.path.join(out, "final.safetensors"))


if __name__ == "__main__":
    main()
