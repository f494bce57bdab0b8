"""Every `name=value` that README.md, docs/*.md and loopkit's own strings (error and warning messages, docstrings)
write is a field of the installed transformers' `TrainingArguments` (or `Seq2SeqTrainingArguments`), or a parameter
of another API that a signature below lists, or one of the few names `OTHER_PARAMETERS` says where they come from
(issue 22: the packing refusal's fix suggested `group_by_length=True`, a field transformers 5.x no longer has; its
field is `train_sampling_strategy="group_by_length"`).

What it cannot see: a stale field name that happens to be a parameter of one of the listed APIs too, and a field
named without `=` (prose such as "the `group_by_length` order").
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# `name=` not preceded by a word character or a dot (so `config.use_cache=` and `x==y` are not read as fields)
ASSIGNMENT = re.compile(r"(?<![\w.])([a-z][a-z0-9_]*)=(?!=)")
# Names written `name=...` whose owner no signature below lists (keywords taken through **kwargs, another program's
# options), each with where it comes from.
OTHER_PARAMETERS = {
    "attn_implementation": "from_pretrained's / a model config's keyword",
    "num_labels": "from_pretrained's / a model config's keyword",
    "loss_type": "a model config's field (docs/differences.md)",
    "block_size": "transformers' run_clm example's option (docs/differences.md)",
    "distributed_type": "accelerate's state (a message of loopkit/distributed.py)",
    "exception": "the keyword loopkit's on_exception event passes",
    "average": "scikit-learn's keyword, quoted by loopkit/metrics.py",
    "zero_division": "scikit-learn's keyword, quoted by loopkit/metrics.py",
    "learning_rat": "the misspelling docs/differences.md shows LoopArgs refusing",
    "gradient_accumulation_kwargs": "a key of accelerator_config (Accelerate's GradientAccumulationPlugin keywords)",
    "tp_plan": "from_pretrained's keyword (tensor parallelism)",
    "skip_logits": "a model's forward keyword that Trainer passes under Liger (docs/arguments.md)",
    "fused_lm_head": "the forward keyword of TRL's fused LM head (trl.trainer.utils.add_fused_lm_head), which "
                     "loopkit/trl/fused.py wraps",
    "scale_wrt_gas": "Accelerator.backward's keyword for DeepSpeed (taken through **kwargs)",
    "loss_scale": "the field of docs/arguments.md's own TrainingArguments subclass (MyArgs)",
    **{key: "a key of the result lines tests/scripts/elastic_jobs.py prints (quoted in docs/distributed.md)"
       for key in ("job", "storage", "kill", "exit", "attempts", "equal", "seconds")},
}


def training_argument_fields() -> set[str]:
    from transformers import Seq2SeqTrainingArguments, TrainingArguments

    return {f.name for cls in (TrainingArguments, Seq2SeqTrainingArguments) for f in dataclasses.fields(cls)}


def parameters_of(obj) -> set[str]:
    """The parameter names of a callable, or of a class's constructor, public methods and dataclass fields."""
    targets = [obj]
    names = set()
    if inspect.isclass(obj):
        # with the methods it inherits from loopkit's own classes (DataStage's parts: loopkit/stages/data_*.py)
        own = [klass for klass in obj.__mro__ if klass is obj or klass.__module__.startswith("loopkit")]
        targets = [obj.__init__] + [m for klass in own for n, m in vars(klass).items()
                                    if callable(m) and not n.startswith("_")]
        if dataclasses.is_dataclass(obj):
            names |= {f.name for f in dataclasses.fields(obj)}
    for target in targets:
        try:
            names |= set(inspect.signature(target).parameters)
        except (TypeError, ValueError):
            pass
    return names - {"self", "kwargs"}


def other_api_parameters() -> set[str]:
    """Parameters of the other APIs the docs and messages write `name=` for: loopkit's public API and stages, HF's
    Trainer, configs, collators, callbacks and optimizers, torch's and accelerate's, TRL's configs and trainers, Ray
    Train's trainer and configs."""
    import accelerate
    import torch
    import transformers
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DataLoaderConfiguration, DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from transformers.optimization import Adafactor
    from transformers.trainer_pt_utils import LabelSmoother

    import torch.distributed.checkpoint as dcp

    import loopkit
    import loopkit.data_order
    import loopkit.metrics
    import loopkit.stages

    owners = [getattr(loopkit, name) for name in loopkit.__all__ if name != "__version__"]
    owners += [o for module in (loopkit.stages, loopkit.metrics) for o in vars(module).values()
               if (inspect.isclass(o) or inspect.isfunction(o)) and o.__module__.startswith("loopkit")]
    owners += [transformers.Trainer, transformers.Seq2SeqTrainer, transformers.PretrainedConfig,
               transformers.LlamaConfig, transformers.GenerationConfig, transformers.DataCollatorWithFlattening,
               transformers.DataCollatorForLanguageModeling, transformers.DataCollatorWithPadding,
               transformers.TrainerCallback, transformers.EarlyStoppingCallback, Adafactor, LabelSmoother,
               loopkit.data_order.ReadAhead, dcp.load, torch.optim.SGD, torch.compile, torch.load, torch.utils.data.DataLoader, torch.nn.CrossEntropyLoss,
               accelerate.Accelerator, FullyShardedDataParallelPlugin, DeepSpeedPlugin, DataLoaderConfiguration,
               ParallelismConfig]
    if importlib.util.find_spec("trl") is not None:  # docs/trl.md writes TRL's arguments (the `trl` extra)
        import trl

        owners += [trl.SFTTrainer, trl.SFTConfig, trl.DPOTrainer, trl.DPOConfig, trl.RewardTrainer,
                   trl.RewardConfig, trl.GRPOTrainer, trl.GRPOConfig]
    if importlib.util.find_spec("ray") is not None:  # docs/distributed.md's Ray Train section (the `ray` extra)
        import ray.train
        from ray.train.torch import TorchTrainer

        owners += [TorchTrainer, ray.train.ScalingConfig, ray.train.RunConfig, ray.train.FailureConfig]
    return set().union(*(parameters_of(owner) for owner in owners))


def sources() -> dict[str, str]:
    """README.md and docs/*.md as text; each loopkit module as its string constants (messages, docstrings)."""
    texts = {str(p.relative_to(REPO_ROOT)): p.read_text() for p in [REPO_ROOT / "README.md",
                                                                     *sorted((REPO_ROOT / "docs").glob("*.md"))]}
    for path in sorted((REPO_ROOT / "loopkit").rglob("*.py")):
        tree = ast.parse(path.read_text())
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        texts[str(path.relative_to(REPO_ROOT))] = "\n".join(strings)
    return texts


def assigned_names(text: str) -> set[str]:
    return {match.group(1) for match in ASSIGNMENT.finditer(text)}


@pytest.fixture(scope="module")
def known():
    fields = training_argument_fields()
    return fields, fields | other_api_parameters() | set(OTHER_PARAMETERS)


def test_every_field_the_docs_and_messages_write_exists_in_the_installed_transformers(known):
    fields, names = known
    unknown = {}
    found_fields = set()
    for where, text in sources().items():
        written = assigned_names(text)
        found_fields |= written & fields
        if written - names:
            unknown[where] = sorted(written - names)
    assert not unknown, ("not a field of the installed TrainingArguments, nor a parameter of another API this test "
                         f"knows: {unknown}")
    # the extraction is not empty: it reads the fields the docs and messages really name
    assert len(found_fields) >= 30, sorted(found_fields)
    assert {"train_sampling_strategy", "use_cache", "per_device_train_batch_size", "torch_compile",
            "gradient_checkpointing", "save_strategy"} <= found_fields


def test_the_check_catches_a_field_transformers_5_no_longer_has(known):
    _, names = known
    old_message = "pad instead of packing (group_by_length=True keeps the padding low)"
    assert assigned_names(old_message) - names == {"group_by_length"}
    fixed = "pad instead of packing (train_sampling_strategy='group_by_length' keeps the padding low)"
    assert assigned_names(fixed) - names == set()
    # a misspelt field in a TrainingArguments call, and an attribute assignment that is not a field
    assert assigned_names("`TrainingArguments(evaluation_strategy='steps')`") - names == {"evaluation_strategy"}
    assert assigned_names("model.config.use_cache=True") == set()
