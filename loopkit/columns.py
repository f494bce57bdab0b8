"""The dataset's columns against the model and the collator: HF's `remove_unused_columns` (drop what the forward does
not take, and, unlike Trainer, never a column the collator asks for: `columns_the_collator_reads`), and the errors
at the cause, before the first batch, that the data stage raises through these: `check_columns` (with
`remove_unused_columns`, a column that is a near miss of a forward argument, or a missing column the forward or a
padding collator needs; for a dataset that is neither a `datasets.Dataset` nor a list, on the first rows its loader
reads), `check_padding` (a padding collator's tokenizer without pad token), and, at construction,
`check_eval_labels` (an unlabelled eval dataset while `metric_for_best_model` needs labels)."""

from __future__ import annotations

import contextlib
import copy
import inspect
import random
import warnings
from collections.abc import KeysView, Mapping

import numpy as np
import torch

from .args import plain
from .batches import is_batch_encoding, without_columns
from .data_order import collator_generators, generator_state
from .errors import config_error, nearest
from .models import base_model
from .private_api import COLLATOR_GENERATOR_ATTRIBUTES


def find_labels(model) -> list[str]:
    """HF's default `label_names`: the forward parameters whose name contains "label" (+ QA positions)."""
    base = base_model(model)
    params = inspect.signature(type(base).forward).parameters
    if "QuestionAnswering" in type(base).__name__:
        return [p for p in params if "label" in p or p in ("start_positions", "end_positions")]
    return [p for p in params if "label" in p]


DATASET_FIELDS = {"training": "train_dataset", "evaluation": "eval_dataset", "test": "test_dataset"}


class RemoveColumnsCollator:
    """Drops the keys the model's forward does not take before the user's collator sees a feature mapping.
    `at_first_batch(features)`, if given, runs on the first call only and returns more keys to keep (the columns
    of an iterable dataset, and those its collator reads, are known only from its first features)."""

    def __init__(self, collator, keep: set[str], at_first_batch=None):
        self.collator, self.keep, self.at_first_batch = collator, keep, at_first_batch

    def __call__(self, features):
        if self.at_first_batch is not None:
            at_first_batch, self.at_first_batch = self.at_first_batch, None
            self.keep = self.keep | at_first_batch(features)
        keep = self.keep
        # The usual row (a dict with nothing to drop) inline: this runs for every row of every batch.
        return self.collator([dict(feature) if type(feature) is dict and feature.keys() <= keep
                              else without_columns(feature, keep) for feature in features])


class AskedRow(dict):
    """A row that notes each key a collator asks for by name (`row[key]`, `key in row`, `key in row.keys()`,
    `row.get(key)`, `row.pop(key)`), present or not. Iterating it asks for nothing: a collator that stacks every
    key it is given (HF's default) reads no column by name."""

    def __init__(self, items, asked: set):
        super().__init__(items)
        self.asked = asked

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)

    def __missing__(self, key):
        self.asked.add(key)
        raise KeyError(key)

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def pop(self, key, *default):
        self.asked.add(key)
        return super().pop(key, *default)

    def keys(self):
        return KeysView(self)  # its `in` is the row's


def columns_the_collator_reads(collator, row, keep: set[str]) -> set[str]:
    """The keys of `row` outside `keep` that `collator` asks for by name (`AskedRow`) when it collates `row`
    without them, i.e. the columns `remove_unused_columns` would take from it: TRL's collators test
    `"seq_lengths" in example` (packing) and `"completion_mask" in example`, a preference collator reads
    `example["chosen_ids"]`. Each one found is given back and the row collated again (a column may be asked for
    only once another is there), until none is new. The collation is a probe: the global RNGs and a collator's
    own generator are as they were afterwards, its warnings are not shown (the real first batch shows them), and
    an error is ignored (the real first batch raises it), and the collation is a copy's (`probe_copy`), so the
    collator's own state (a count, a list of what it saw) is as it was. A collator that copies its rows first
    (`dict(row)`) and asks the copy is not seen."""
    row = row.data if is_batch_encoding(row) else row
    if not isinstance(row, Mapping):
        return set()
    droppable, read = set(row) - keep, set()
    probed = probe_copy(collator) if droppable else None  # nothing to drop (the usual dataset): no probe
    while droppable - read:
        asked = set()
        probe = AskedRow({key: value for key, value in row.items() if key in keep or key in read}, asked)
        with randomness_kept(probed), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                probed([probe])
            except Exception:  # noqa: BLE001 - the real first batch raises it, where it belongs
                pass
        found = (asked & droppable) - read
        if not found:
            break
        read |= found
    return read


def probe_copy(collator):
    """A deep copy of `collator` that shares the models and tokenizers it holds (large, and not changed by
    collating: an `nn.Module`, anything with `model_input_names`); the collator itself where it cannot be
    copied (its generators and the global RNGs are restored around the probe either way: `randomness_kept`)."""
    memo, seen, pending = {}, set(), [collator]
    for _ in range(4):  # the collator, what it holds, and two levels below (a wrapper's collator's tokenizer)
        found = []
        for value in pending:
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, torch.nn.Module) or hasattr(value, "model_input_names"):
                memo[id(value)] = value
            elif isinstance(value, (list, tuple)):
                found += list(value)
            elif isinstance(value, dict):
                found += list(value.values())
            elif hasattr(value, "__dict__") and not isinstance(value, type):
                found += list(vars(value).values())
        pending = found
    try:
        return copy.deepcopy(collator, memo)
    except Exception:  # noqa: BLE001 - a lock, a file handle: probe the collator itself
        return collator


@contextlib.contextmanager
def randomness_kept(collator):
    """Python's, NumPy's and torch's global RNGs, and the seeded generators of `collator` and the collators it
    wraps, as they were before the block (a collator that masks or shuffles draws from them)."""
    owners = [(owner, {name: vars(owner)[name] for name in COLLATOR_GENERATOR_ATTRIBUTES if name in vars(owner)},
               generator_state(owner)) for owner in collator_generators(collator)]
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
            for owner, attributes, state in owners:
                for name in COLLATOR_GENERATOR_ATTRIBUTES:
                    if name in attributes:
                        setattr(owner, name, attributes[name])
                    elif name in vars(owner):
                        delattr(owner, name)
                if isinstance(state, torch.Tensor):
                    owner.generator.set_state(state)
                elif state is not None:
                    owner.generator.bit_generator.state = state


def dataset_columns(dataset) -> list[str] | None:
    """The column names of a `datasets.Dataset`, or the keys of a list's first row; None for any other dataset,
    whose rows are known only once the loader reads them (reading one here could have side effects: an
    augmentation drawing from the RNG, a dataset counting its reads)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):
        return names
    if isinstance(dataset, (list, tuple)) and dataset and isinstance(dataset[0], Mapping):
        return list(dataset[0].keys())
    return None


def collator_input_name(collator) -> str | None:
    """The input one of HF's tokenizer collators cannot do without (`tokenizer.pad` needs `model_input_names[0]`);
    None for any other collator (a user's may build its inputs itself)."""
    if not type(collator).__module__.startswith("transformers."):
        return None
    names = getattr(getattr(collator, "tokenizer", None), "model_input_names", None)
    return names[0] if names else None


def check_padding(collator, processing_class) -> None:
    """`DataCollatorWithPadding` calls `tokenizer.pad` on every batch, which fails without a pad token: say so
    before the first batch (once, when the run's collator is chosen)."""
    from transformers.data.data_collator import DataCollatorWithPadding

    tokenizer = getattr(collator, "tokenizer", None)
    if not isinstance(collator, DataCollatorWithPadding) or getattr(tokenizer, "pad_token", "") is not None:
        return
    field = "processing_class.pad_token" if tokenizer is processing_class else \
        "data_collator.tokenizer.pad_token"
    raise config_error(field, None, f"{type(collator).__name__} pads every batch with it, and "
                       f"{type(tokenizer).__name__} has none", "set tokenizer.pad_token = tokenizer.eos_token "
                       "before building the Loop (and model.config.pad_token_id = tokenizer.pad_token_id for a "
                       "sequence classifier), or add one with tokenizer.add_special_tokens({'pad_token': "
                       "'[PAD]'}) and model.resize_token_embeddings(len(tokenizer))")


def check_eval_labels(args, eval_dataset, label_names: list[str], data_collator) -> None:
    """At construction: `metric_for_best_model` is read from every evaluation during training, and evaluation
    has a loss and metrics only with labels. Refuse an eval dataset whose columns hold none, where the collator
    is known not to make them (HF's default collators; a collator that makes labels, e.g. for language
    modelling, is trusted)."""
    if args.metric_for_best_model is None or plain(args.eval_strategy) == "no" or not label_names:
        return
    if not collator_keeps_labels_as_is(data_collator):
        return
    datasets = eval_dataset.items() if isinstance(eval_dataset, dict) else [(None, eval_dataset)]
    accepted = set(label_names) | {"label", "label_ids"}  # the default collators rename these to labels
    for key, dataset in datasets:
        columns = dataset_columns(dataset)
        if columns is not None and not accepted & set(columns):
            field = "eval_dataset" if key is None else f"eval_dataset[{key!r}]"
            raise config_error(
                "metric_for_best_model", args.metric_for_best_model,
                f"each evaluation during training computes it from labels, and {field} has no label column "
                f"(its columns: {', '.join(columns)}; label_names={label_names})",
                f"add the labels to {field} as a {label_names[0]!r} or 'label' column, or set label_names "
                f"to the column holding them, or unset metric_for_best_model (and load_best_model_at_end)")


def collator_keeps_labels_as_is(collator) -> bool:
    """Whether the run's collator is one of HF's that never makes labels (so the dataset must hold them)."""
    from transformers.data.data_collator import DataCollatorWithPadding, default_data_collator

    return collator is None or collator is default_data_collator or type(collator) is DataCollatorWithPadding


def signature_columns(model, label_names: list[str], declared: list[str] | None = None) -> set[str]:
    """The columns `remove_unused_columns` keeps: `declared` where the run declares them (HF's
    `_signature_columns`, as TRL's trainers set them), else the model forward's arguments and the labels."""
    if declared is not None:
        return set(declared) | set(label_names)
    base = base_model(model)
    columns = set(inspect.signature(base.forward).parameters)
    return columns | {"label", "label_ids"} | set(label_names)


def with_model_columns(dataset, collator, description: str, model, label_names: list[str],
                       declared: list[str] | None = None):
    """`remove_unused_columns`: drop what the forward does not take and the collator does not ask for (columns of a
    `datasets.Dataset` or keys of a list's rows, known from the first row now; else the keys of each feature dict,
    before the collator, known at the first batch). First, refuse to drop a column by mistake (`check_columns`)."""
    keep = signature_columns(model, label_names, declared)
    columns, row = dataset_columns(dataset), first_row(dataset)
    if row is None:  # an iterable dataset: the collator's columns and the checks at its first batch
        def at_first_batch(features) -> set[str]:
            if not features or not isinstance(features[0], Mapping):
                return set()
            read = columns_the_collator_reads(collator, features[0], keep)
            if declared is None:
                check_columns(list(features[0].keys()), collator, description, model, label_names, read)
            return read
        return dataset, RemoveColumnsCollator(collator, keep, at_first_batch)
    keep = keep | columns_the_collator_reads(collator, row, keep)
    if declared is None:
        check_columns(columns, collator, description, model, label_names, keep)
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, list) and hasattr(dataset, "remove_columns"):
        unused = [c for c in column_names if c not in keep]
        if len(unused) == len(column_names):
            raise config_error("remove_unused_columns", True, f"no column of the {description} dataset "
                               f"({', '.join(column_names)}) is an argument of the model's forward",
                               "rename the columns to the model's inputs or set remove_unused_columns=False")
        return (dataset.remove_columns(unused) if unused else dataset), collator
    return dataset, RemoveColumnsCollator(collator, keep)


def first_row(dataset):
    """The first row of a dataset whose columns are known without reading it (`dataset_columns`) and that is
    indexable (a `datasets.Dataset`, a list), to find the columns the collator reads; None for any other (an
    iterable dataset: its first batch tells)."""
    if dataset_columns(dataset) is None or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None
    return dataset[0] if len(dataset) else None


def check_columns(columns: list[str], collator, description: str, model, label_names: list[str],
                  read: set[str] = frozenset()) -> None:
    """Before the first batch: refuse a column that `remove_unused_columns` would drop (it is neither a forward
    argument nor one of `read`, those the collator asks for) although its name is a near miss of a forward
    argument no column provides (`input_idz`), and a missing column that the forward (an argument without
    default, when the collator is HF's default one, which makes no input of its own) or a padding collator
    (the tokenizer's main input) cannot do without."""
    from transformers.data.data_collator import default_data_collator

    base = base_model(model)
    params = inspect.signature(base.forward).parameters
    arguments = [p for p, v in params.items() if v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]
    field, model_name = DATASET_FIELDS.get(description, description), type(base).__name__
    keep, unprovided = signature_columns(model, label_names) | read, [a for a in arguments if a not in columns]
    for column in (c for c in columns if c not in keep):
        match = nearest(column, unprovided)
        if match:
            raise config_error(
                "remove_unused_columns", True,
                f"it would drop the column {column!r} of {field}, which is no argument of {model_name}.forward; "
                f"did you mean its argument {match[0]!r}, which no column provides?",
                f"rename the column to {match[0]!r} (datasets: dataset.rename_column({column!r}, "
                f"{match[0]!r})), or, if your collator reads {column!r}, set remove_unused_columns=False")
    needed = {}
    if collator is default_data_collator:  # labels may be absent (prediction) or renamed from "label"
        needed = {a: f"{model_name}.forward" for a, v in params.items()
                  if a in arguments and v.default is v.empty and a not in label_names}
    collator_input = collator_input_name(collator)
    if collator_input is not None:
        needed.setdefault(collator_input, f"the collator {type(collator).__name__} (it pads them)")
    for name, who in needed.items():
        if name not in columns:
            raise config_error(
                f"{field} columns", columns, f"{who} needs a {name!r} column, and none is there (with "
                f"remove_unused_columns=True only columns named after {model_name}.forward's arguments reach it)",
                f"give {field} a {name!r} column (for text: map the tokenizer over it), or, if your collator "
                f"builds {name!r} from other columns, set remove_unused_columns=False")
