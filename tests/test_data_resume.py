"""The resume point's four cases (loopkit/stages/data_resume.py) and the step arithmetic (data_plan.py), as plain
functions: each case's numbers, checked without a run (tests/test_resume_exact.py resumes real runs)."""

import warnings
from types import SimpleNamespace

import pytest
import torch

from loopkit.stages.data_plan import TrainingPlan, training_plan
from loopkit.stages.data_resume import resume_at_epoch_start, resume_from_global_step, resume_from_position

# 10 micro-batches per epoch, accumulation 3: 4 optimizer steps per epoch (the last one of 1 micro-batch).
PLAN = TrainingPlan(num_train_epochs=2, num_update_steps_per_epoch=4, num_examples=20, num_train_samples=40,
                    total_train_batch_size=6, steps_in_epoch=10, max_steps=8)


def test_ignore_data_skip_starts_the_current_epoch_from_its_first_batch():
    point = resume_at_epoch_start("ckpt", global_step=6, plan=PLAN, rng={"seed": 1})
    assert (point.epochs_trained, point.micro_batches_to_skip, point.rng) == (1, 0, {"seed": 1})


def test_an_hf_checkpoint_is_placed_by_its_global_step_as_hf_places_it():
    point = resume_from_global_step("ckpt", global_step=6, plan=PLAN, accumulation=3, rng=None)
    assert (point.epochs_trained, point.micro_batches_to_skip, point.read_ahead) == (1, 6, None)


def saved(epoch, micro_batches, samples, processes=1, dataset_state=None):
    position = {"epoch": epoch, "micro_batches": micro_batches, "samples": samples}
    if dataset_state is not None:
        position["dataset_state"] = dataset_state
    batch = {"tensor": torch.arange(2)}
    return {"position": position, "read_ahead": {"processes": processes, "batch": batch}}


def test_a_loopkit_checkpoint_resumes_after_its_samples_with_the_batch_read_ahead():
    point = resume_from_position("ckpt", saved(0, 6, 12, dataset_state={"at": 12}), PLAN, samples_per_micro_batch=2,
                                 processes=1, epochs_end=True, rng=None)
    assert (point.epochs_trained, point.micro_batches_to_skip, point.dataset_state) == (0, 6, {"at": 12})
    assert torch.equal(point.read_ahead, torch.arange(2))


def test_other_processes_or_batch_sizes_keep_the_samples_and_read_the_batch_again():
    point = resume_from_position("ckpt", saved(0, 6, 12), PLAN, 2, processes=2, epochs_end=True, rng=None)
    assert (point.micro_batches_to_skip, point.read_ahead) == (6, None)  # another number of processes
    point = resume_from_position("ckpt", saved(0, 6, 12), PLAN, 4, processes=1, epochs_end=True, rng=None)
    assert (point.micro_batches_to_skip, point.read_ahead) == (3, None)  # micro-batches of 4 samples
    with pytest.warns(UserWarning, match="after 12 samples, so 2 of them are trained on again"):
        point = resume_from_position("ckpt", saved(0, 7, 14), PLAN, 4, processes=1, epochs_end=True, rng=None)
    assert point.micro_batches_to_skip == 3


def test_a_checkpoint_at_the_epochs_end_resumes_at_the_next_epochs_start():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        point = resume_from_position("ckpt", saved(0, 10, 20), PLAN, 2, processes=1, epochs_end=True, rng=None)
    assert (point.epochs_trained, point.micro_batches_to_skip, point.read_ahead) == (1, 0, None)
    point = resume_from_position("ckpt", saved(0, 10, 20), PLAN, 2, processes=1, epochs_end=False, rng=None)
    assert (point.epochs_trained, point.micro_batches_to_skip) == (0, 10)  # a loader without a length: no end


@pytest.mark.parametrize("max_steps,expected", [(-1, (2, 4, 20, 40, 6, 10, 8)), (5, (2, 4, 20, 30, 6, 10, 5))])
def test_the_plan_of_a_loader_with_a_length(max_steps, expected):
    class Loader:  # 10 micro-batches of 2 over 20 samples
        dataset = list(range(20))

        def __len__(self):
            return 10

    args = SimpleNamespace(gradient_accumulation_steps=3, max_steps=max_steps, num_train_epochs=2)
    plan = training_plan(Loader(), args, batch_size=2, num_processes=1)
    assert (plan.num_train_epochs, plan.num_update_steps_per_epoch, plan.num_examples, plan.num_train_samples,
            plan.total_train_batch_size, plan.steps_in_epoch, plan.max_steps) == expected
