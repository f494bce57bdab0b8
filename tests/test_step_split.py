"""stages/step.py was split by job (issue 35, section 4): the loss semantics went to loopkit/loss.py, model
introspection to loopkit/models.py, work counting to loopkit/work.py. Every name imported from loopkit.stages.step
before the split still imports from there, and is the object of its new module."""

import importlib

MOVED = {
    "loopkit.loss": ["model_loss"],
    "loopkit.models": ["is_causal_lm", "is_causal_lm_class", "causal_lm_class_names", "has_plain_train",
                       "PLAIN_TRAIN_METHODS", "base_model"],
    "loopkit.first_batch": ["check_labels"],
}
STAYED = ["StepStage", "StepResult", "TrainMode", "NO_CONTEXT", "has_train_mode"]


def test_every_name_of_the_step_module_still_imports_from_it_and_is_its_new_modules():
    step = importlib.import_module("loopkit.stages.step")
    for module_name, names in MOVED.items():
        module = importlib.import_module(module_name)
        for name in names:
            assert getattr(step, name) is getattr(module, name), (name, module_name)
    for name in STAYED:
        assert hasattr(step, name), name
    assert set(step.__all__) == {name for names in MOVED.values() for name in names} | set(STAYED)


def test_the_stage_methods_delegate_to_the_new_modules():
    """The step stage's HF methods keep their names and signatures; their bodies are the new modules' functions."""
    import inspect

    from loopkit.stages.step import StepStage

    assert list(inspect.signature(StepStage.compute_loss).parameters) == [
        "self", "model", "inputs", "return_outputs", "num_items_in_batch"]
    assert list(inspect.signature(StepStage.count_loss_items).parameters) == ["self", "batches"]
    assert list(inspect.signature(StepStage.floating_point_ops).parameters) == ["self", "inputs"]
    stage = StepStage()
    assert stage.floating_point_ops({"input_ids": None}) == 0  # no model yet: HF's estimate is 0
    assert stage.work_by_shape is None  # before training there is no work counter
