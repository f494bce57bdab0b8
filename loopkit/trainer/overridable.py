"""HF Trainer's overridable methods and attribute names on `Loop`, and the one path an override takes.

Each overridable method has one owning stage (`OWNERS`). On a plain `Loop` the method runs the owning stage's
implementation. On a `Loop` subclass that overrides it, `bind_overrides` puts the override onto the owning stage at
construction: the stage then calls it wherever it would call its own (with `self` being the `Loop`, as on a
`Trainer` subclass), and `super().compute_loss(...)` inside it reaches the stage's implementation. Overriding the
same method on a `Loop` subclass and on a swapped stage is ambiguous, so it is an error at construction.
`create_accelerator_and_postprocess` is the `Loop`'s own: it hands what the setup stage makes (the `Accelerator`,
the gather function) to the run context.

The `Loop`'s HF attribute names (`trainer.model`, `trainer.optimizer`, `trainer.state`, ...) are views onto the run
state and the run context (`loopkit/run_state.py`); assigning one (a user's script or callback may) writes the field.
"""

from __future__ import annotations

import inspect

from ..errors import config_error

# method -> the stage that owns it (the `Loop` attribute the stage is found under)
OWNERS = {
    "call_model_init": "setup",
    "get_train_dataloader": "data", "get_eval_dataloader": "data", "get_test_dataloader": "data",
    "get_resumed_dataloader": "data",
    "create_optimizer": "step", "get_optimizer_cls_and_kwargs": "step", "create_scheduler": "step",
    "get_decay_parameter_names": "step", "compute_loss": "step", "compute_loss_context_manager": "step",
    "autocast_smart_context_manager": "step", "training_step": "step", "floating_point_ops": "step",
    "count_loss_items": "step",
    "evaluate": "evaluation", "predict": "evaluation", "evaluation_loop": "evaluation",
    "prediction_step": "evaluation",
}

# `Loop` attribute -> the run-state field it shows (`model_wrapped` and `callback_handler` are special: below).
RUN_VIEWS = ("args", "model", "optimizer", "lr_scheduler", "state", "control", "train_dataset",
             "eval_dataset", "data_collator", "processing_class", "model_init", "compute_loss_func", "compute_metrics",
             "preprocess_logits_for_metrics", "optimizer_cls_and_kwargs", "label_names", "train_dataloader",
             "model_accepts_loss_kwargs", "metrics", "label_smoother", "is_in_train")
# `Loop` attribute -> the context's service it shows (the context's callables are the `Loop`'s own methods).
CONTEXT_VIEWS = ("accelerator", "gather_function", "preemption", "clock", "checkpointer")


def run_view(name: str, holder: str = "run") -> property:
    return property(lambda self: getattr(getattr(self, holder), name),
                    lambda self, value: setattr(getattr(self, holder), name, value),
                    doc=f"The run {'state' if holder == 'run' else 'context'}'s `{name}` (loopkit/run_state.py).")


class StagesStaticMethod:
    """HF's staticmethod `name` (`Trainer.get_optimizer_cls_and_kwargs(args, model)`), answered by the owning stage in
    use: on a `Loop`, its own stage (`step=` passed in, or the class's); on the class, the class's stage class."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, loop, cls):
        owner = OWNERS[self.name]
        if loop is not None and owner in vars(loop):
            return getattr(getattr(loop, owner), self.name)
        stage_classes = getattr(cls, "stage_classes", None)  # `Loop`'s; HFMethods alone has none
        return self if stage_classes is None else getattr(stage_classes[owner], self.name)


class HFMethods:
    """The overridable methods, each running its owning stage's implementation (see the module docstring)."""

    #: HF 5.x: whether `compute_loss` already normalises over the accumulated batch (None: HF's rule). Set on a
    #: `Loop` subclass, it is handed to the step stage (loopkit/stages/step.py explains the rule).
    loss_is_scaled_for_ga = None

    def __setattr__(self, name, value):
        """HF allows replacing a method on one Trainer (`trainer.compute_loss = my_loss`): here it takes the same
        path as a subclass override, onto the owning stage."""
        super().__setattr__(name, value)
        if name in OWNERS and "default_stages" in vars(self):
            bind_override(self, name, value)

    def stage_method(self, name: str):
        """The owning stage's own implementation of `name` (never a `Loop` override bound onto the stage)."""
        stage = getattr(self, OWNERS[name])
        return getattr(type(stage), name).__get__(stage)

    def call_model_init(self, trial=None):
        return self.stage_method("call_model_init")(trial)

    def create_accelerator_and_postprocess(self) -> None:
        """HF's hook, called once at construction: the setup stage makes the `Accelerator` and the gather function,
        and the context holds them (an override sees them as `self.accelerator` after `super()`, as in HF)."""
        self.context.accelerator, self.context.gather_function = self.setup.create_accelerator_and_gather()

    def get_train_dataloader(self):
        return self.stage_method("get_train_dataloader")()

    def get_eval_dataloader(self, eval_dataset=None):
        return self.stage_method("get_eval_dataloader")(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        return self.stage_method("get_test_dataloader")(test_dataset)

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        return self.stage_method("get_resumed_dataloader")(dataloader, num_batches)

    def create_optimizer(self, model=None):
        return self.stage_method("create_optimizer")(model)

    get_optimizer_cls_and_kwargs = StagesStaticMethod("get_optimizer_cls_and_kwargs")

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return self.stage_method("create_scheduler")(num_training_steps, optimizer)

    def get_decay_parameter_names(self, model) -> list[str]:
        return self.stage_method("get_decay_parameter_names")(model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self.stage_method("compute_loss")(model, inputs, return_outputs, num_items_in_batch)

    def compute_loss_context_manager(self):
        return self.stage_method("compute_loss_context_manager")()

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        return self.stage_method("autocast_smart_context_manager")(cache_enabled)

    def training_step(self, model, inputs, num_items_in_batch=None):
        return self.stage_method("training_step")(model, inputs, num_items_in_batch)

    def floating_point_ops(self, inputs) -> int:
        return self.stage_method("floating_point_ops")(inputs)

    def count_loss_items(self, batches):
        return self.stage_method("count_loss_items")(batches)

    # `**gen_kwargs`: `generate`'s keywords, which only a generating evaluation stage takes (`Seq2SeqLoop`'s).
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **gen_kwargs) -> dict:
        return self.stage_method("evaluate")(eval_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test", **gen_kwargs):
        return self.stage_method("predict")(test_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        return self.stage_method("evaluation_loop")(dataloader, description, prediction_loss_only, ignore_keys,
                                                    metric_key_prefix)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        return self.stage_method("prediction_step")(model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs)

    @property
    def model_wrapped(self):
        """The model as `accelerator.prepare` wrapped it for training; the model itself before that (HF)."""
        return self.run.model_wrapped if self.run.model_wrapped is not None else self.run.model

    @property
    def callback_handler(self):
        """The callbacks and their dispatch (HF's name for it)."""
        return self.context.events


for _name in RUN_VIEWS:
    setattr(HFMethods, _name, run_view(_name))
for _name in CONTEXT_VIEWS:
    setattr(HFMethods, _name, run_view(_name, "context"))


def bind_overrides(loop, default_stages: dict) -> None:
    """Put each method a `Loop` subclass overrides onto its owning stage; refuse an override on both sides.
    `default_stages`: stage name -> loopkit's default class for it."""
    loop.default_stages = default_stages
    for name in OWNERS:
        if inspect.getattr_static(type(loop), name) is not inspect.getattr_static(HFMethods, name):
            bind_override(loop, name, getattr(loop, name))
    scaled = type(loop).loss_is_scaled_for_ga
    if scaled is not None:
        if type(loop.step).loss_is_scaled_for_ga not in (None, scaled):
            raise config_error("loss_is_scaled_for_ga", scaled, f"{type(loop).__name__} and "
                               f"{type(loop.step).__name__} declare different values",
                               "declare it where compute_loss is defined")
        loop.step.loss_is_scaled_for_ga = scaled


def bind_override(loop, name: str, method) -> None:
    """`method` (bound to the `Loop`) becomes what the owning stage calls as `name`, and what the run context offers
    the other stages under that name."""
    owner = OWNERS[name]
    stage = getattr(loop, owner)
    if getattr(type(stage), name) is not getattr(loop.default_stages[owner], name):
        raise config_error(
            owner, type(stage).__name__, f"both {type(loop).__name__}.{name} and {type(stage).__name__}.{name} "
            f"override {name}, and only one can run", f"define {name} in one of the two places")
    setattr(stage, name, method)
    if name in vars(loop.context):  # compute_loss, get_eval_dataloader, ...: offered to other stages by the context
        setattr(loop.context, name, method)
