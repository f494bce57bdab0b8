"""Streaming evaluation metrics: running sums on the device, updated batch by batch, reduced across processes once.

HF's `compute_metrics` receives every prediction of the eval set at once, so evaluation memory grows with the eval
set (N x seq x vocab logits for a language model). A streaming metric keeps a few running sums instead, so memory
stays flat however large the eval set is:

    from loopkit.metrics import Perplexity, TokenAccuracy

    loop = Loop(model, args, eval_dataset=eval_ds, metrics=[TokenAccuracy(), Perplexity()])
    loop.evaluate()   # {"eval_loss": ..., "eval_token_accuracy": ..., "eval_perplexity": ..., "eval_runtime": ...}

Each evaluation calls, on every process:
* `reset(device)` once, before the first batch;
* `update(outputs, batch)` for every batch: `outputs.logits` are the model's raw logits for the batch (what
  `prediction_step` returns as logits: a tensor, or a tuple when the model returns several outputs), `outputs.loss`
  the batch's mean loss (None without labels), and `batch` the model's inputs, labels included. Samples that
  Accelerate repeats to even out the last batch across processes are cut off before `update`, so every sample
  counts once;
* `sync(accelerator)` once, after the last batch: every running sum is gathered from all processes and reduced;
* `compute()`: a number (stored under the metric's `name`) or a dict of numbers (stored under its keys). The keys
  get the evaluation's prefix (`eval_`, `test_`, `eval_<dataset>_`) like HF's metrics.

Nothing in `update` may move data to the host (`.item()`, `.cpu()`, boolean-mask indexing): that would stall the
device at every batch. The only host transfer is the final number.

Writing your own: subclass `Metric`, declare running sums with `add_state`, add to them in `update`, and turn them
into a number in `compute`; `reset` and `sync` come with the base class:

    class MeanAbsoluteError(Metric):
        name = "mae"

        def __init__(self):
            super().__init__()
            self.add_state("abs_error", torch.zeros((), dtype=torch.float64))
            self.add_state("count", torch.zeros((), dtype=torch.int64))

        def update(self, outputs, batch):
            error = (outputs.logits.squeeze(-1) - batch["labels"]).abs()
            self.abs_error += error.sum()
            self.count += error.numel()

        def compute(self):
            return self.abs_error / self.count
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

# How a running state combines across processes: the gathered copies are stacked on a new first dimension.
REDUCTIONS = {
    "sum": lambda stacked: stacked.sum(0),
    "max": lambda stacked: stacked.amax(0),
    "min": lambda stacked: stacked.amin(0),
}


@dataclass
class BatchOutputs:
    """What `update` receives as `outputs`: the batch's mean loss and its logits, as `prediction_step` returns them."""

    loss: torch.Tensor | None
    logits: Any


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Metric:
    """Base class for streaming metrics: named running states on the device, reset before each evaluation and reduced
    across processes (sum, max or min) before `compute`. Subclasses implement `update` and `compute`."""

    #: The result key when `compute` returns a single number; defaults to the class name in snake_case.
    name: str | None = None

    def __init__(self, name: str | None = None):
        if name is not None:
            self.name = name
        elif self.name is None:
            self.name = snake_case(type(self).__name__)
        self.state_defaults: dict[str, tuple[torch.Tensor, str]] = {}

    def add_state(self, name: str, default: torch.Tensor, reduce: str = "sum") -> None:
        """Declare a running state `self.<name>`, starting at `default` and combined across processes by `reduce`."""
        if reduce not in REDUCTIONS:
            raise ValueError(f"add_state({name!r}, reduce={reduce!r}): loopkit reduces states by "
                             f"{', '.join(map(repr, REDUCTIONS))}. Fix: use one of those (keep a sum and a count "
                             f"rather than a mean).")
        if not isinstance(default, torch.Tensor):
            raise TypeError(f"add_state({name!r}, default={default!r}): the default must be a torch.Tensor, e.g. "
                            f"torch.zeros(()) for a scalar sum or torch.zeros(num_classes) for one per class.")
        self.state_defaults[name] = (default.detach().clone(), reduce)
        setattr(self, name, default.detach().clone())

    def reset(self, device=None) -> None:
        """Every state back to its default, on `device` (the accelerator's device during evaluation)."""
        for name, (default, _) in self.state_defaults.items():
            setattr(self, name, default.to(device, copy=True))

    def sync(self, accelerator) -> None:
        """Replace each state by its reduction over all processes (a no-op copy on one process)."""
        for name, (_, reduce) in self.state_defaults.items():
            stacked = accelerator.gather(getattr(self, name).unsqueeze(0))  # (num_processes, *state shape)
            setattr(self, name, REDUCTIONS[reduce](stacked))

    def update(self, outputs: BatchOutputs, batch: Mapping) -> None:
        raise NotImplementedError(f"{type(self).__name__}.update(outputs, batch) is not implemented.")

    def compute(self):
        raise NotImplementedError(f"{type(self).__name__}.compute() is not implemented.")


# ---------------------------------------------------------------------------------------------------------------
# Built-in metrics
# ---------------------------------------------------------------------------------------------------------------
def first_tensor(logits) -> torch.Tensor:
    """The logits tensor: `prediction_step` gives a tuple when the model returns several outputs, logits first."""
    return logits[0] if isinstance(logits, (tuple, list)) else logits


def batch_labels(metric, batch) -> torch.Tensor:
    """`batch[metric.label_key]`, or an error naming the key and what the batch has (a tuple batch is read by
    position)."""
    key = metric.label_key
    try:
        return batch[key]
    except (KeyError, IndexError, TypeError):
        has = f"keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else \
            f"{len(batch)} positions" if isinstance(batch, (list, tuple)) else f"type {type(batch).__name__}"
        raise KeyError(f"{type(metric).__name__}(label_key={key!r}) reads the labels from batch[{key!r}], which this "
                       f"batch lacks (it has {has}). Fix: label_key=<the labels' key>, or their position in a tuple "
                       f"batch (label_key=1).") from None


def warn_if_nothing_counted(metric, counted: torch.Tensor) -> bool:
    """At `compute` (one host read per evaluation): a metric that counted no label is NaN, and says why. Returns
    whether nothing was counted."""
    empty = int(counted) == 0
    if empty:
        warnings.warn(f"Streaming metric {type(metric).__name__} ({metric.name!r}) counted no label in this "
                      f"evaluation, so it is NaN: every label was ignore_index={metric.ignore_index}. Likely cause: "
                      f"labels masked or truncated away, or ignore_index/label_key not matching the data.",
                      stacklevel=3)
    return empty


def aligned(logits: torch.Tensor, labels: torch.Tensor, shift: bool):
    """Logits and labels position by position; `shift` pairs position t's logits with label t+1 (causal LMs)."""
    if shift:
        return logits[:, :-1], labels[:, 1:]
    return logits, labels


class Accuracy(Metric):
    """Share of labels equal to the argmax of the logits, ignoring labels equal to `ignore_index`. Works for sequence
    classification (logits [B, C], labels [B]) and token classification (logits [B, T, C], labels [B, T])."""

    name = "accuracy"
    shift = False

    def __init__(self, ignore_index: int = IGNORE_INDEX, label_key: str = "labels", name: str | None = None):
        super().__init__(name)
        self.ignore_index, self.label_key = ignore_index, label_key
        self.add_state("correct", torch.zeros((), dtype=torch.int64))
        self.add_state("total", torch.zeros((), dtype=torch.int64))

    def update(self, outputs, batch):
        logits, labels = aligned(first_tensor(outputs.logits), batch_labels(self, batch), self.shift)
        counted = labels != self.ignore_index
        self.correct += ((logits.argmax(-1) == labels) & counted).sum()
        self.total += counted.sum()

    def compute(self):
        warn_if_nothing_counted(self, self.total)
        return self.correct.double() / self.total


class TokenAccuracy(Accuracy):
    """Accuracy of next-token predictions for causal LMs: position t's logits against label t+1 (`shift=True`), the
    same pairing as the model's loss; labels equal to -100 (padding, prompt) are ignored. `shift=False` for masked
    LMs, whose labels sit at the predicted position."""

    name = "token_accuracy"

    def __init__(self, shift: bool = True, ignore_index: int = IGNORE_INDEX, label_key: str = "labels",
                 name: str | None = None):
        super().__init__(ignore_index, label_key, name)
        self.shift = shift


class Perplexity(Metric):
    """exp of the mean cross-entropy over all label tokens of the eval set (the global token mean, so long and short
    batches weigh by their token counts), computed from the logits. `shift=True` for causal LMs, as in
    `TokenAccuracy`."""

    name = "perplexity"

    def __init__(self, shift: bool = True, ignore_index: int = IGNORE_INDEX, label_key: str = "labels",
                 name: str | None = None):
        super().__init__(name)
        self.shift, self.ignore_index, self.label_key = shift, ignore_index, label_key
        self.add_state("nll_sum", torch.zeros((), dtype=torch.float64))
        self.add_state("tokens", torch.zeros((), dtype=torch.int64))

    def update(self, outputs, batch):
        logits, labels = aligned(first_tensor(outputs.logits), batch_labels(self, batch), self.shift)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                              ignore_index=self.ignore_index, reduction="sum")
        self.nll_sum += nll.double()
        self.tokens += (labels != self.ignore_index).sum()

    def compute(self):
        warn_if_nothing_counted(self, self.tokens)
        return torch.exp(self.nll_sum / self.tokens)


class PrecisionRecallF1(Metric):
    """Precision, recall and F1 of the argmax predictions, per class and macro-averaged.

    Results: `precision`, `recall`, `f1` (macro: the unweighted mean over the classes that occur in the labels or the
    predictions, as scikit-learn's `average="macro"`), and with `per_class=True` also `precision_<c>`, `recall_<c>`,
    `f1_<c>` for every class `c` (its index, or its name from `class_names`). A class without predictions has
    precision 0, one without labels recall 0 (scikit-learn's `zero_division=0`). Labels equal to `ignore_index` are
    skipped; labels must lie in `[0, num_classes)`. `prefix` goes before every key (two instances need different
    prefixes).
    """

    def __init__(self, num_classes: int, per_class: bool = True, class_names=None, ignore_index: int = IGNORE_INDEX,
                 label_key: str = "labels", shift: bool = False, prefix: str = ""):
        super().__init__(f"{prefix}f1")
        self.prefix = prefix
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"class_names has {len(class_names)} names for num_classes={num_classes}. Fix: give one "
                             f"name per class.")
        self.num_classes, self.per_class = num_classes, per_class
        self.class_names = list(class_names) if class_names is not None else list(range(num_classes))
        self.ignore_index, self.label_key, self.shift = ignore_index, label_key, shift
        for state in ("true_positives", "predicted", "actual"):
            self.add_state(state, torch.zeros(num_classes, dtype=torch.int64))

    def update(self, outputs, batch):
        logits, labels = aligned(first_tensor(outputs.logits), batch_labels(self, batch), self.shift)
        predictions, labels = logits.argmax(-1).reshape(-1), labels.reshape(-1)
        counted = (labels != self.ignore_index).long()
        # Ignored positions are sent to class 0 with weight 0: no boolean indexing, hence no host sync.
        safe_labels = torch.where(counted.bool(), labels, 0)
        safe_predictions = torch.where(counted.bool(), predictions, 0)
        self.true_positives.index_add_(0, safe_labels, counted * (predictions == labels).long())
        self.predicted.index_add_(0, safe_predictions, counted)
        self.actual.index_add_(0, safe_labels, counted)

    def compute(self):
        tp, predicted, actual = self.true_positives.double(), self.predicted.double(), self.actual.double()
        precision = torch.where(predicted > 0, tp / predicted.clamp(min=1), 0.0)
        recall = torch.where(actual > 0, tp / actual.clamp(min=1), 0.0)
        both = predicted + actual
        f1 = torch.where(both > 0, 2 * tp / both.clamp(min=1), 0.0)
        present = both > 0
        classes = present.sum().clamp(min=1)
        result = {"precision": (precision * present).sum() / classes, "recall": (recall * present).sum() / classes,
                  "f1": (f1 * present).sum() / classes}
        if self.per_class:
            for i, class_name in enumerate(self.class_names):
                result.update({f"precision_{class_name}": precision[i], f"recall_{class_name}": recall[i],
                               f"f1_{class_name}": f1[i]})
        if warn_if_nothing_counted(self, self.actual.sum()):  # 0 of 0 is undefined, not a silent 0.0
            result = {key: torch.full_like(value, torch.nan) for key, value in result.items()}
        return {f"{self.prefix}{key}": value for key, value in result.items()}


# ---------------------------------------------------------------------------------------------------------------
# What the evaluation loop calls
# ---------------------------------------------------------------------------------------------------------------
def check_metrics(metrics, num_processes: int = 1) -> list:
    """Validate `Loop(metrics=...)` at construction: a list of objects with `update` and `compute` (and, on several
    processes, `sync`). Returns the list."""
    if metrics is None:
        return []
    if callable(getattr(metrics, "update", None)) and callable(getattr(metrics, "compute", None)):
        raise TypeError(f"metrics={metrics!r}: expected a list of metrics. "
                        f"Fix: metrics=[{type(metrics).__name__}(...)].")
    try:
        metrics = list(metrics)
    except TypeError:
        raise TypeError(f"metrics={metrics!r}: expected a list of metric objects. Fix: a function of the whole "
                        f"EvalPrediction goes to compute_metrics=...; metrics=[...] takes loopkit.metrics objects."
                        ) from None
    for i, metric in enumerate(metrics):
        if isinstance(metric, type):
            raise TypeError(f"metrics[{i}]={metric.__name__} is a class. Fix: pass an instance, {metric.__name__}().")
        missing = [m for m in ("update", "compute") if not callable(getattr(metric, m, None))]
        if missing:
            raise TypeError(f"metrics[{i}]={metric!r} has no {' or '.join(missing)} method. A streaming metric needs "
                            f"update(outputs, batch) and compute(). Fix: subclass loopkit.metrics.Metric, or use "
                            f"compute_metrics=... for a function of the whole EvalPrediction.")
        if num_processes > 1 and not callable(getattr(metric, "sync", None)):
            raise TypeError(f"metrics[{i}]={metric!r} has no sync(accelerator) method, so on {num_processes} "
                            f"processes each would compute its own share only. Fix: subclass loopkit.metrics.Metric "
                            f"and declare its running sums with add_state (they are then reduced for you).")
    return metrics


def reset_all(metrics, device) -> None:
    for metric in metrics:
        if callable(getattr(metric, "reset", None)):
            metric.reset(device)


def real_rows(accelerator, rows: int) -> int:
    """How many of this process's `rows` in the current batch are real samples.

    To give every process a full last batch, Accelerate repeats samples from the start of the eval set. Gathered in
    process order, the real samples of that last batch are the first `gradient_state.remainder` rows (what
    `gather_for_metrics` keeps), so process p keeps `remainder - p * rows` of its rows, between 0 and `rows`. Elsewhere,
    or when the dataset length is unknown (remainder -1), every row is real.
    """
    state = accelerator.gradient_state
    if not state.end_of_dataloader or state.remainder is None or state.remainder <= 0:
        return rows
    return max(0, min(rows, state.remainder - accelerator.process_index * rows))


def first_rows(value, rows: int, batch_rows: int):
    """`value` cut to its first `rows` samples: every tensor whose first dimension is the batch's."""
    if isinstance(value, torch.Tensor):
        return value[:rows] if value.ndim >= 1 and value.shape[0] == batch_rows else value
    if isinstance(value, Mapping):
        return {k: first_rows(v, rows, batch_rows) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(first_rows(v, rows, batch_rows) for v in value)
    return value


def update_all(metrics, outputs: BatchOutputs, batch, rows: int, batch_rows: int) -> None:
    """One batch into every metric, without the samples Accelerate repeated (see `real_rows`)."""
    if rows == 0:
        return
    if rows < batch_rows:
        outputs = BatchOutputs(outputs.loss, first_rows(outputs.logits, rows, batch_rows))
        batch = first_rows(batch, rows, batch_rows)
    for metric in metrics:
        metric.update(outputs, batch)


def warn_no_rows(metrics, label_names, last_batch) -> None:
    """An evaluation whose batches reached no streaming metric: they report nothing (as HF's compute_metrics without
    labels), and say why instead of staying silent."""
    names = ", ".join(getattr(m, "name", None) or type(m).__name__ for m in metrics)
    if last_batch is None:
        cause = "the eval set gave no batch"
    elif not label_names:
        cause = "label_names is empty (the model's forward has no argument named like 'label')"
    else:
        has = sorted(map(str, last_batch)) if isinstance(last_batch, Mapping) else type(last_batch).__name__
        cause = f"no batch carried every column of label_names={list(label_names)} (the last batch has {has})"
    warnings.warn(f"The streaming metrics ({names}) received no labelled batch in this evaluation and report "
                  f"nothing: {cause}. Fix: put the labels in the batches (check the collator and "
                  f"remove_unused_columns), or name them with TrainingArguments(label_names=[...]).", stacklevel=3)


def compute_all(metrics, accelerator) -> dict:
    """Reduce every metric across processes and collect the results by key (tensors stay on the device here; the
    caller converts them to numbers once)."""
    results: dict = {}
    for metric in metrics:
        if callable(getattr(metric, "sync", None)):
            metric.sync(accelerator)
        value = metric.compute()
        if not isinstance(value, Mapping):
            value = {getattr(metric, "name", None) or snake_case(type(metric).__name__): value}
        for key, number in value.items():
            if key in results:
                raise ValueError(f"Two streaming metrics produce the key {key!r}. Fix: give one of them another "
                                 f"name, e.g. {type(metric).__name__}(..., name='{key}_2').")
            results[key] = number
    return results
