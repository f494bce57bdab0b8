"""Recipe 7: LoRA fine-tuning with peft: only the adapters (and the new classification head) train, only they reach
the optimizer, and they are saved on their own and reloaded onto a fresh copy of the base model.

* `get_peft_model` freezes the base model and adds rank-8 adapters to the attention's `query` and `value`
  projections; for sequence classification peft also keeps the new `classifier` head trainable (`modules_to_save`).
* The loop's optimizer takes only parameters with `requires_grad` (as HF Trainer's does), so AdamW keeps moments
  for ~0.3% of MiniLM's weights, not all of them.
* `loop.save_model(dir)` calls peft's `save_pretrained`: `adapter_config.json` + `adapter_model.safetensors`
  (adapters and head, a few hundred KB), not the 90 MB base model. `PeftModel.from_pretrained(base, dir)` puts them
  back on a freshly loaded base model, whose own head is deliberately initialised differently: the reloaded model
  must still give the trained model's outputs.
"""

from __future__ import annotations

import os

import torch

from common import Size, accuracy, cli, load_classifier, loop_args, output_folder, review_datasets
from loopkit import Loop


def lora_model(size: Size, rank: int = 8):
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=rank, lora_alpha=2 * rank, lora_dropout=0.1,
                        target_modules=["query", "value"])
    return get_peft_model(load_classifier(size), config)


def reload_adapters(size: Size, adapter_dir: str):
    from peft import PeftModel

    fresh_base = load_classifier(size, seed=1234)  # a different random head: the saved one must replace it
    return PeftModel.from_pretrained(fresh_base, adapter_dir).eval()


@torch.no_grad()
def logits_of(model, dataset, count: int = 16) -> torch.Tensor:
    batch = {k: v[:count] for k, v in dataset.columns.items() if k != "labels"}
    return model.eval()(**batch).logits


def main(tiny: bool = False, output_dir: str | None = None, max_steps: int = -1):
    size = Size.pick(tiny)
    train, evaluation = review_datasets(size)
    model = lora_model(size)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.2f}%)")
    output_dir = output_folder(output_dir, "lora")
    # Adapters start at zero and are few: LoRA wants a larger learning rate than full fine-tuning.
    args = loop_args(output_dir, size, max_steps=max_steps, learning_rate=1e-2 if tiny else 3e-3)
    loop = Loop(model=model, args=args, train_dataset=train, eval_dataset=evaluation, compute_metrics=accuracy)
    loop.train()
    loop.evaluate()  # printed by the loop's log printer

    adapter_dir = os.path.join(output_dir, "adapter")
    loop.save_model(adapter_dir)
    print(f"saved {sorted(os.listdir(adapter_dir))}")
    reloaded = reload_adapters(size, adapter_dir)
    difference = (logits_of(reloaded, evaluation) - logits_of(loop.model, evaluation)).abs().max().item()
    print(f"reloaded adapters: largest logit difference from the trained model {difference:.2e}")
    return loop, reloaded, adapter_dir


if __name__ == "__main__":
    cli(main, __doc__)
