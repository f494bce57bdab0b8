"""Run configuration: `LoopArgs`, and the check that the arguments (a `LoopArgs` or a `transformers.TrainingArguments`)
ask for nothing loopkit ignores.

`Loop` accepts either a real `transformers.TrainingArguments` (the one-word migration from `Trainer`) or `LoopArgs`,
a light dataclass with every field of the installed `TrainingArguments`, its names and defaults read from
transformers' source (tests/test_args_derived.py compares them with the imported class). Both are read through the
same attribute names, so the rest of loopkit never asks which one it got.

The package, one module per job:
- `fields.py`: the fields of the installed `TrainingArguments`, read from its source, and loopkit's review of them
  (the tables of supported, inert and engine fields; a field in none of them is refused when it is changed);
- `loop_args.py`: the `LoopArgs` dataclass, its derivations (`TrainingArguments.__post_init__`'s) and its check of
  unknown keywords;
- `refusals.py`: what `TrainingArguments.__post_init__` refuses, refused when a `LoopArgs` is built (and again by
  `check_args`);
- `checks.py`: `check_args` and `check_inputs`, and the tables of choices and fixes they read.
Every name is importable from `loopkit.args` too, as when it was one module.
"""

# LoopConfigError, MetricNotFoundError, trainer_error and plain are importable from here too (loopkit.args, as before).
from ..errors import (LoopConfigError, MetricNotFoundError, RuntimeConfigError, UnknownArgumentError,  # noqa: F401
                      config_error, nearest, plain, trainer_error)
from ..optimizers import check_optim  # noqa: F401
from .checks import (FIXES, SUPPORTED_CHOICES, TRL_LOOPS, ArgsClassDeclaration, check_args,  # noqa: F401
                     check_debug_options, check_declared_fields, check_inputs, check_intervals,
                     check_unsupported_fields, refusal, trainer_field_names, transformers_quiet)
from .fields import (ACCELERATE_ENGINE_FIELDS, INERT_FIELDS, SUPPORTED_FIELDS, check_reviewed_fields,  # noqa: F401
                     unsupported_field_error)
from .refusals import (ENUM_OF_FIELD, check_bf16, check_tf32, check_training_options, enum_refusal,  # noqa: F401
                       refuse_as_training_arguments)
from .loop_args import (DICT_FIELDS, LOOP_ARGS_FIELDS, SEQ2SEQ_FIELDS, LoopArgs,  # noqa: F401
                        check_best_model_schedule, reject_unknown_keywords, report_to_list, unknown_argument_error)
