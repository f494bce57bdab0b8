"""What docs/stages.md says about a data stage with a sampler of its own: the loop calls the sampler's `set_epoch`
at every epoch, and a mid-epoch resume skips the trained micro-batches with that sampler too, so the resumed run
sees the batches the uninterrupted run saw after the checkpoint and ends with the same weights."""

import os

import torch
from torch.utils.data import DataLoader, Sampler
from transformers import default_data_collator

from loopkit import DataStage, Loop

from helpers import assert_same_weights, hf_args, regression_data, tiny_regression


class EpochSampler(Sampler):
    """A permutation drawn from its seed and the epoch it was last given."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch, self.epochs_set = n, seed, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


class OwnSamplerData(DataStage):
    def get_train_dataloader(self):
        run = self.run
        self.sampler = EpochSampler(len(run.train_dataset), seed=7)
        loader = DataLoader(run.train_dataset, batch_size=run.args.per_device_train_batch_size, sampler=self.sampler,
                            collate_fn=default_data_collator)
        return self.context.accelerator.prepare(loader)


def train_recording_inputs(output_dir, resume=None):
    model = tiny_regression()
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["x"].clone()), with_kwargs=True)
    args = hf_args(output_dir, num_train_epochs=2, per_device_train_batch_size=4, learning_rate=0.05,
                   save_strategy="steps", save_steps=3, logging_steps=1)
    data = OwnSamplerData()
    loop = Loop(model=model, args=args, train_dataset=regression_data(24), data=data)
    loop.train(resume_from_checkpoint=resume)
    return loop, data.sampler, seen


def test_the_loop_sets_the_epoch_of_a_users_sampler_and_resumes_with_it(tmp_path):
    whole, whole_sampler, whole_seen = train_recording_inputs(tmp_path / "whole")
    assert whole_sampler.epochs_set == [0, 1]
    assert len(whole_seen) == 12  # 24 samples, batch 4, 2 epochs: no batch skipped or repeated
    assert not all(torch.equal(a, b) for a, b in zip(whole_seen[:6], whole_seen[6:]))  # epoch 1's order differs

    checkpoint = os.path.join(tmp_path / "whole", "checkpoint-3")  # mid-epoch 0 (6 steps per epoch)
    resumed, resumed_sampler, resumed_seen = train_recording_inputs(tmp_path / "resumed", resume=checkpoint)
    assert resumed_sampler.epochs_set == [0, 1]
    assert len(resumed_seen) == 9
    assert all(torch.equal(a, b) for a, b in zip(resumed_seen, whole_seen[3:]))
    assert_same_weights(resumed.model, whole.model, rtol=0.0)  # exact: the same batches in the same order
