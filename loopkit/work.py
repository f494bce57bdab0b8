"""Work counting for the step stage: HF's FLOP estimate, the input tokens and the samples of each micro-batch.

`total_flos` (HF's `floating_point_ops`: 6 x elements of the main input x non-embedding parameters), HF's
`num_input_tokens_seen` (`include_num_input_tokens_seen`: "all" tokens of the main input, or "non_padding": the
attention mask's sum, else the tokens that are not the pad token), and the tokens and samples the run report divides
by time. Sizes are tensor metadata and token counts stay device tensors: nothing here waits for the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from .batches import find_batch_size


def hf_floating_point_ops(inputs, main_input: str, num_non_embedding_params: int) -> int:
    """HF's estimate for one forward + backward: 6 x elements of the main input x non-embedding parameters; 0
    for a model without `num_parameters`. Any mapping counts (collators return `BatchEncoding`, not a dict)."""
    if isinstance(inputs, Mapping) and main_input in inputs and num_non_embedding_params:
        return 6 * inputs[main_input].numel() * num_non_embedding_params
    return 0


def non_embedding_parameters(model) -> int:
    """The model's non-embedding parameters as `num_parameters` counts them, with a parameter DeepSpeed ZeRO-3 has
    partitioned counted at its full size (`ds_numel`): before the first forward each rank holds an empty
    placeholder, and counting those gives 0 (HF Trainer counts after the first forward and gets only the parameters
    ZeRO-3 keeps whole: both wrong, docs/differences.md). 0 for a model without `num_parameters`, as HF's estimate."""
    if not hasattr(model, "num_parameters"):
        return 0
    if not any(hasattr(parameter, "ds_numel") for parameter in model.parameters()):
        return model.num_parameters(exclude_embeddings=True)
    embeddings = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)}
    return sum(parameter.ds_numel if hasattr(parameter, "ds_numel") else parameter.numel()
               for name, parameter in model.named_parameters() if name not in embeddings)


def batch_size(inputs) -> int:
    """HF's `find_batch_size`, with its common case (a mapping whose first value is a batched tensor) inlined."""
    if type(inputs) is dict or isinstance(inputs, Mapping):
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.ndim:
                return value.shape[0]
            break
    return find_batch_size(inputs) or 0


class WorkCounter:
    """Counts one micro-batch's work into a step result (its `flos`, `tokens`, `samples`, `input_tokens_seen`).

    `floating_point_ops(inputs)`: the FLOP estimate (the step stage's, overridable as on a Trainer); with
    `cache_by_shape` (HF's estimate, which depends on the main input's shape only) it is computed once per shape.
    `input_tokens`: `include_num_input_tokens_seen` ("no", "all", "non_padding"); `pad_token_id`: the processing
    class's, for "non_padding" batches without an attention mask."""

    def __init__(self, main_input: str, floating_point_ops, cache_by_shape: bool, input_tokens: str = "no",
                 pad_token_id=None):
        self.main_input, self.floating_point_ops = main_input, floating_point_ops
        self.by_shape = {} if cache_by_shape else None  # main input shape -> (FLOPs, tokens, samples)
        self.input_tokens_mode, self.pad_token_id = input_tokens, pad_token_id
        self.warned_no_main_input = False

    def count(self, inputs, result) -> None:
        main = inputs.get(self.main_input) if type(inputs) is dict or isinstance(inputs, Mapping) else None
        if self.input_tokens_mode != "no":
            result.input_tokens_seen = result.input_tokens_seen + self.input_tokens(inputs, main)
        if not isinstance(main, torch.Tensor):  # no main input (a plain module taking `x`): samples only
            if self.by_shape is None:  # HF's estimate is 0 without the main input; an override may differ
                result.flos += float(self.floating_point_ops(inputs))
            result.samples += batch_size(inputs)
            return
        work = self.by_shape.get(main.shape) if self.by_shape is not None else None
        if work is None:
            work = (float(self.floating_point_ops(inputs)), main.numel(), main.shape[0] if main.ndim else 1)
            if self.by_shape is not None:
                self.by_shape[main.shape] = work
        result.flos += work[0]
        result.tokens += work[1]
        result.samples += work[2]

    def input_tokens(self, inputs, main) -> torch.Tensor | int:
        """HF's `_track_num_input_tokens` for one micro-batch: every token of the main input ("all"), or the
        attention mask's sum / the tokens that are not padding ("non_padding"), a device tensor (no sync)."""
        if not isinstance(main, torch.Tensor):
            if not self.warned_no_main_input:
                warnings.warn(f"include_num_input_tokens_seen: the batch has no {self.main_input!r} (the model's "
                              f"main_input_name), so its tokens are not counted (as HF Trainer does).")
                self.warned_no_main_input = True
            return 0
        if self.input_tokens_mode == "non_padding":
            if "attention_mask" in inputs:
                return inputs["attention_mask"].sum()
            if self.pad_token_id is not None:
                return (main != self.pad_token_id).sum()
        return main.numel()
