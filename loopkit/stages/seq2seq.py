"""The generating evaluation stage: HF's `Seq2SeqTrainer` evaluation (transformers 5.24), as `EvalStage` subclass.

`Seq2SeqLoop` (loopkit/seq2seq_loop.py) uses it by default; `Loop(..., evaluation=Seq2SeqEvalStage())` is the same run.

Contract (`EvalStage`'s, plus):
* `evaluate(..., **gen_kwargs)` and `predict(..., **gen_kwargs)` take `generate`'s keywords (`max_length`,
  `max_new_tokens`, `num_beams`, ...). Where neither `max_length` nor `max_new_tokens` is given,
  `args.generation_max_length` is the `max_length`; where `num_beams` is not given, `args.generation_num_beams`.
  `prediction_step` uses the keywords of the latest `evaluate` / `predict` unless it is passed its own.
* With `args.predict_with_generate` (and predictions wanted), `prediction_step` returns the tokens that
  `run.model.generate(...)` produced as the predictions, padded to the model's generation config's `max_length`
  (or `max_new_tokens + 1`) with the pad token, the labels padded likewise, and the loss of `model(**inputs)` (the
  model's own loss, as HF: not `compute_loss`). Decoder inputs the collator built from the labels are left out of
  `generate`'s inputs. Without it, `EvalStage.prediction_step` runs.
* `args.generation_config` (a `GenerationConfig`, a file, or a directory with `generation_config.json`) replaces
  the model's generation config at `on_init_end`, validated strictly as HF does.

One difference from HF, on purpose: `Seq2SeqTrainer.evaluate` / `predict` switch the trainer's `gather_function`
from `accelerator.gather_for_metrics` to `accelerator.gather` (for good). Each batch's loss is repeated
`per_device_eval_batch_size` times before the gather, so without the truncation `gather_for_metrics` does, a short
last batch weighs as a full one in `eval_loss` (7 samples in batches of 3, 3, 1: (a + b + c) / 3 instead of
(3a + 3b + c) / 7, which is what `Trainer` reports for the same model and data); with several processes the samples
Accelerate repeats to even out the last batch are also kept, in the predictions too. This stage keeps the run's
`gather_for_metrics`, so its `eval_loss` is `Trainer`'s and every sample counts once; predictions, labels and
`compute_metrics` results are HF's.

Reads, beyond `EvalStage`: `run.model` (its `generate` and generation config), `run.processing_class` (the pad
token). Writes no run-state field; it changes the model's `generation_config` as HF does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from copy import deepcopy
from pathlib import Path

import torch

from ..errors import config_error
from ..private_api import fill_generation_defaults
from .evaluation import EvalStage


def load_generation_config(value):
    """HF's `Seq2SeqTrainer.load_generation_config`: a copy of a `GenerationConfig`, or one read from a file, a
    directory or a model id; validated strictly (`save_pretrained` would refuse it at the end of training)."""
    from transformers import GenerationConfig

    if isinstance(value, GenerationConfig):
        config = deepcopy(value)
    else:
        path, file_name = Path(value), None
        if path.is_file():
            path, file_name = path.parent, path.name
        config = GenerationConfig.from_pretrained(path if path.is_dir() else value, file_name)
    try:
        config.validate(strict=True)
    except ValueError as exc:
        raise ValueError(f"{exc}\n\nFix these issues to train your model.") from exc
    return config


def generation_kwargs(args, given: dict) -> dict:
    """`generate`'s keywords for one evaluation: the given ones, then the arguments' `generation_max_length` and
    `generation_num_beams` where not given (HF's order)."""
    kwargs = dict(given)
    max_length = getattr(args, "generation_max_length", None)
    if kwargs.get("max_length") is None and kwargs.get("max_new_tokens") is None and max_length is not None:
        kwargs["max_length"] = max_length
    num_beams = getattr(args, "generation_num_beams", None)
    if kwargs.get("num_beams") is None and num_beams is not None:
        kwargs["num_beams"] = num_beams
    return kwargs


class Seq2SeqEvalStage(EvalStage):
    """Evaluation and prediction that generate (HF's `Seq2SeqTrainer`); see the module docstring."""

    generates = True

    def __init__(self, **checkpoint_options):
        super().__init__(**checkpoint_options)
        self.gen_kwargs = {}  # `generate`'s keywords of the latest evaluate / predict

    def on_init_end(self, args, state, control, **kwargs):
        """The arguments' generation config replaces the model's (as at the end of `Seq2SeqTrainer.__init__`)."""
        run = self.run
        if getattr(args, "predict_with_generate", False) and run.metrics:
            raise config_error("metrics", [type(m).__name__ for m in run.metrics], "streaming metrics read logits, "
                               "and predict_with_generate=True makes the predictions generated token ids",
                               "compute generation metrics in compute_metrics, or set predict_with_generate=False")
        if getattr(args, "generation_config", None) is not None:
            run.model.generation_config = load_generation_config(args.generation_config)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **gen_kwargs) -> dict:
        self.gen_kwargs = generation_kwargs(self.run.args, gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **gen_kwargs):
        self.gen_kwargs = generation_kwargs(self.run.args, gen_kwargs)
        return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        args = self.run.args
        if not getattr(args, "predict_with_generate", False) or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        # HF tests `"labels" in inputs`; DataCollatorForSeq2Seq puts `labels: None` in an unlabelled batch
        has_labels = inputs.get("labels") is not None
        generated = self.generate(inputs, gen_kwargs or dict(self.gen_kwargs))
        max_length, max_new_tokens = self.generation_lengths()
        generated = self.pad_to_generation_length(generated, max_length, max_new_tokens)
        loss = self.model_loss(model, inputs) if has_labels else None
        if args.prediction_loss_only:
            return loss, None, None
        labels = self.pad_to_generation_length(inputs["labels"], max_length, max_new_tokens) if has_labels else None
        return loss, generated, labels

    def generate(self, inputs, gen_kwargs: dict) -> torch.Tensor:
        """`run.model.generate` on the batch, without the decoder inputs the collator made from the labels."""
        model = self.run.model
        for name in ("num_beams", "max_length"):
            if name in gen_kwargs and gen_kwargs[name] is None:
                del gen_kwargs[name]
        gen_kwargs.setdefault("synced_gpus", synced_gpus_default(model))
        generation_inputs = dict(inputs)
        if inputs.get("labels") is not None and inputs.get("decoder_input_ids") is not None and \
                inputs["labels"].shape == inputs["decoder_input_ids"].shape:
            for name in ("decoder_input_ids", "decoder_attention_mask"):
                generation_inputs.pop(name, None)
        with full_parameters(model):
            return model.generate(**generation_inputs, **gen_kwargs)

    def generation_lengths(self) -> tuple:
        """The model's generation config's `max_length` and `max_new_tokens`, its unset values filled with the
        defaults (HF does this after every `generate`, and so changes the model's config the same way)."""
        config = self.run.model.generation_config
        fill_generation_defaults(config)
        return config.max_length, config.max_new_tokens

    def pad_to_generation_length(self, tensor: torch.Tensor, max_length: int, max_new_tokens) -> torch.Tensor:
        """Right-padded with the pad token to `max_length`, or to `max_new_tokens + 1` (HF's rule)."""
        if tensor.shape[-1] < max_length:
            return self.pad_right(tensor, max_length)
        if max_new_tokens is not None and tensor.shape[-1] < max_new_tokens + 1:
            return self.pad_right(tensor, max_new_tokens + 1)
        return tensor

    def pad_right(self, tensor: torch.Tensor, length: int) -> torch.Tensor:
        padded = torch.full((tensor.shape[0], length), self.pad_token_id(), dtype=tensor.dtype, device=tensor.device)
        padded[:, :tensor.shape[-1]] = tensor
        return padded

    def pad_token_id(self) -> int:
        """The processing class's pad token (else its EOS), or the model config's (HF's order)."""
        processing_class = self.run.processing_class
        if processing_class is not None and hasattr(processing_class, "pad_token_id"):
            pad = processing_class.pad_token_id
            return pad if pad is not None else processing_class.eos_token_id
        pad = getattr(self.run.model.config, "pad_token_id", None)
        if pad is None:
            raise config_error("pad_token_id", None, "generated tokens and labels are padded to one length, and "
                               "neither the processing class nor the model config has a pad token",
                               "pass processing_class=tokenizer, or set model.config.pad_token_id")
        return pad

    def model_loss(self, model, inputs) -> torch.Tensor:
        """The batch's loss as the model computes it (HF's generating `prediction_step` calls the model directly)."""
        with torch.no_grad(), self.context.compute_loss_context_manager():
            outputs = model(**inputs)
        return (outputs["loss"] if isinstance(outputs, Mapping) else outputs[0]).detach().mean()


def synced_gpus_default(model) -> bool:
    """Every process keeps generating until all are done when the weights are sharded (DeepSpeed ZeRO-3, FSDP)."""
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)


def full_parameters(model):
    """FSDP (v1) must gather the full parameters for `generate`; anything else needs nothing."""
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return FullyShardedDataParallel.summon_full_params(model)
    return contextlib.nullcontext()
