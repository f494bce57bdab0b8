"""The training function tests/test_ray_train.py hands Ray Train's `TorchTrainer` (`train_loop_per_worker`): what a
Trainer user writes for Ray, with `Loop` or HF `Trainer` swapped in. A tiny Llama from a config on real Rotten
Tomatoes reviews (the MiniLM tokenizer, HF's causal-LM collator: BatchEncoding, -100 at the padding, an uneven last
batch), Ray's `prepare_trainer` and `RayTrainReportCallback`, resuming from `ray.train.get_checkpoint()` as Ray's
guide does. Ray imports this module in its workers (the test puts this folder on their PYTHONPATH).

`config`: runs (trained one after the other, each a dict: name, runner "loop" or "hf", storage "hf", "dcp" or
"dcp-async" for Loop, fsdp (FSDP2 through TrainingArguments' fsdp fields), output_dir, kill), results (a folder: each
rank writes <name>-attempt<a>-rank<r>.json, rank 0 also <name>-attempt<a>.safetensors, the final weights),
kill_step. A run with `kill` loses rank 1 to a SIGKILL at the end of step kill_step once: that attempt leaves the
marker file killed-<name>, and the retry resumes the run from Ray's latest checkpoint. An attempt counts the
markers it finds (attempt 0, 1, ...) and skips the runs every rank of an earlier attempt finished.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from safetensors.torch import save_file
from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import minilm_tokenizer, rotten_tomatoes, tiny_llama  # noqa: E402
from on_save_child import storage_for  # noqa: E402  (this folder)

MAX_STEPS, SAVE_STEPS, SAMPLES = 8, 2, 60  # 60 reviews, 8 per global step: the 8th step has 4 (uneven)


def reviews():
    """The tokenized reviews as a `datasets.Dataset`, and the collator (padding labelled -100)."""
    import datasets

    tokenizer = minilm_tokenizer()
    encoded = tokenizer([text for text, _ in rotten_tomatoes(SAMPLES)], truncation=True, max_length=24)
    dataset = datasets.Dataset.from_dict({key: encoded[key] for key in ("input_ids", "attention_mask")})
    return dataset, DataCollatorForLanguageModeling(tokenizer, mlm=False), tokenizer.vocab_size


def arguments(config: dict) -> TrainingArguments:
    fsdp = dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                                "state_dict_type": "SHARDED_STATE_DICT"}) if config["fsdp"] else {}
    return TrainingArguments(output_dir=config["output_dir"], use_cpu=True, max_steps=MAX_STEPS,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3,
                             warmup_steps=2, weight_decay=0.01, logging_steps=1, save_steps=SAVE_STEPS,
                             optim="adamw_torch", seed=7, report_to="none", disable_tqdm=True,
                             dataloader_num_workers=0, **fsdp)


REPORT_POLL_WAIT_S = 5  # Ray's controller collects the workers' reports every 2 s: the kill lets it see the last one


class KillOnce(TrainerCallback):
    """SIGKILL of this worker at the end of step `step` when the marker file is absent (it writes it first): the
    first attempt dies there, the retry runs through. It waits REPORT_POLL_WAIT_S first, so that Ray has most likely
    registered the reports made before (a report the controller has not collected when a worker dies is lost)."""

    def __init__(self, step: int | None, marker: str):
        self.step, self.marker = step, marker

    def on_step_end(self, args, state, control, **kwargs):
        if self.step == state.global_step and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(state.global_step))
            time.sleep(REPORT_POLL_WAIT_S)
            os.kill(os.getpid(), signal.SIGKILL)


class SavedOnEveryRank(TrainerCallback):
    """For HF Trainer's runs: every rank waits in `on_save` until all have saved, before Ray's callback copies the
    checkpoint. Trainer calls `on_save` on each rank once that rank's own part is written, so rank 1 (which writes
    only its RNG state) copied checkpoint-N while rank 0 still wrote model.safetensors, and safetensors 0.8's
    temporary file (.tmpXXXXXX, renamed when written) vanished under the copy. loopkit's `on_save` comes after the
    checkpoint's commit on every rank: its runs are left as a user writes them."""

    def on_save(self, args, state, control, **kwargs):
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


def final_weights(trainer) -> dict:
    """The trained model's full weights (FSDP2's shards gathered: a collective, every rank calls it)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().contiguous()
            for k, v in model.state_dict().items()}


def train_one(run: dict, results: str, rank: int, attempt: int, kill: KillOnce, resume: bool) -> None:
    """One training run as a Trainer user writes it for Ray: the runner, Ray's callback and `prepare_trainer`, and
    with `resume`, a resume from Ray's latest checkpoint (the retry of a run that lost a worker: Ray's latest report
    is that run's, made before the kill)."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    from loopkit import Loop

    dataset, collator, vocab_size = reviews()
    options = {"storage": storage_for(run["storage"])} if run["runner"] == "loop" else {}
    runner = Loop if run["runner"] == "loop" else Trainer
    before_ray = [] if run["runner"] == "loop" else [SavedOnEveryRank()]
    trainer = runner(model=tiny_llama(vocab_size=vocab_size), args=arguments(run), train_dataset=dataset,
                     data_collator=collator, callbacks=[*before_ray, RayTrainReportCallback(), kill], **options)
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint() if resume else None
    if checkpoint:
        with checkpoint.as_directory() as folder:
            resumed_from = os.path.join(folder, RayTrainReportCallback.CHECKPOINT_NAME)
            with open(os.path.join(resumed_from, "trainer_state.json")) as f:
                resumed_step = json.load(f)["global_step"]
            trainer.train(resume_from_checkpoint=resumed_from)
    else:
        resumed_step = None
        trainer.train()
    weights = final_weights(trainer)
    prefix = os.path.join(results, f"{run['name']}-attempt{attempt}")
    with open(f"{prefix}-rank{rank}.json", "w") as f:
        json.dump({"log_history": trainer.state.log_history, "resumed_step": resumed_step}, f)
    if rank == 0:
        save_file(weights, f"{prefix}.safetensors")


def finished(results: str, name: str, world_size: int) -> bool:
    """Every rank of an earlier attempt wrote its record of run `name` (each writes it before its next run's first
    collective, so the ranks agree on which runs are done)."""
    done = [f for f in os.listdir(results) if f.startswith(f"{name}-attempt") and f.endswith(".json")]
    return all(any(f.endswith(f"-rank{rank}.json") for f in done) for rank in range(world_size))


def train_func(config: dict) -> None:
    """Ray's `train_loop_per_worker`: each run of `config["runs"]` in turn (module docstring)."""
    import ray.train

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    results = config["results"]
    attempt = sum(name.startswith("killed-") for name in os.listdir(results))
    for run in config["runs"]:
        if finished(results, run["name"], world_size):
            continue
        marker = os.path.join(results, f"killed-{run['name']}")
        kill = KillOnce(config["kill_step"] if rank == 1 and run.get("kill") else None, marker)
        train_one(run, results, rank, attempt, kill, resume=os.path.exists(marker))
