"""Checkpoint files that would run code, without launching processes.

loopkit/dcp_reading.py: a real DCP folder (model and AdamW state, written by `dcp.save` in this process) reads back
equal through `read_dcp`; planted pickles, in `.metadata` or in a non-tensor value of a `.distcp` file, are refused
with the file named and never run. (The 2-process FSDP2 resume with planted metadata is in tests/test_fsdp.py.)
The DeepSpeed resume (`load_deepspeed_checkpoint`) given planted files, with a stand-in engine that loads as
DeepSpeed's checkpoint engine does (`torch.load(weights_only=False)`); the real engine's resumes are in
tests/test_deepspeed.py.
"""

from __future__ import annotations

import builtins
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from loopkit.checkpoint import load_model_weights
from loopkit.dcp_reading import UnsafeCheckpointError, load_metadata, read_dcp
from loopkit.checkpoint.engines import FSDP_MODEL_FOLDER, load_deepspeed_checkpoint, load_sharded_model, \
    load_sharded_optimizer


class Call:
    """Unpickles as `function(*args)`: what a planted pickle does."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))


def trained(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return optimizer


def save(state: dict, folder) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process": it is
        dcp.save(state, checkpoint_id=str(folder))
    return str(folder)


@pytest.fixture
def checkpoint(tmp_path):
    """`checkpoint/pytorch_model_fsdp_0/` and `checkpoint/optimizer_0/`, as a sharded FSDP checkpoint holds them."""
    model = tiny_model()
    optimizer = trained(model)
    save({"model": get_model_state_dict(model)}, tmp_path / "checkpoint" / FSDP_MODEL_FOLDER)
    save({"optimizer": get_optimizer_state_dict(model, optimizer)}, tmp_path / "checkpoint" / "optimizer_0")
    return tmp_path / "checkpoint", model, optimizer


def metadata_path(checkpoint, folder=FSDP_MODEL_FOLDER) -> str:
    return str(checkpoint / folder / ".metadata")


def plant(path: str, payload) -> None:
    """The real metadata with `payload` inside (a reader that unpickles it runs the payload, then loads normally)."""
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    metadata.storage_meta.save_id = payload
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("folder", [FSDP_MODEL_FOLDER, "optimizer_0"])
def test_a_real_metadata_loads_equal_to_pickle(checkpoint, folder):
    path = metadata_path(checkpoint[0], folder)
    with open(path, "rb") as f:
        data = f.read()
    assert load_metadata(data, path) == pickle.loads(data)


def test_real_folders_read_back_equal(checkpoint):
    folder, model, optimizer = checkpoint
    fresh = tiny_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    load_model_weights(fresh, str(folder))  # the path of load_best_model_at_end and of an unsharded resume
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    load_sharded_optimizer(fresh, fresh_optimizer, str(folder / "optimizer_0"))
    loaded, expected = fresh_optimizer.state_dict(), optimizer.state_dict()
    assert loaded["param_groups"] == expected["param_groups"]  # lr, betas: the non-tensor values
    for index, state in expected["state"].items():
        assert all(torch.equal(loaded["state"][index][key], value) for key, value in state.items())


@pytest.mark.parametrize("payload", ["os.system", "eval", "exec", "getattr", "torch.load",
                                     "a DCP class not in the list"])
def test_planted_metadata_is_refused_with_the_file_named_and_never_runs(checkpoint, tmp_path, payload):
    marker = tmp_path / "payload-ran"
    command = f"open({str(marker)!r}, 'w').close()"
    planted = {"os.system": Call(os.system, f"touch {marker}"), "eval": Call(builtins.eval, command),
               "exec": Call(builtins.exec, command),
               "getattr": Call(getattr, Call(builtins.__import__, "os"), "system"),
               "torch.load": Call(torch.load, str(marker)),
               "a DCP class not in the list": Call(dcp.FileSystemReader, str(tmp_path))}[payload]
    folder = checkpoint[0]
    plant(metadata_path(folder), planted)
    with pytest.raises(UnsafeCheckpointError, match="Refusing to load") as refused:
        load_sharded_model(tiny_model(), str(folder / FSDP_MODEL_FOLDER))
    assert metadata_path(folder) in str(refused.value)
    assert not marker.exists()


def test_what_is_not_dcp_metadata_is_refused(tmp_path):
    path = str(tmp_path / ".metadata")
    with pytest.raises(UnsafeCheckpointError, match="holds a dict, not DCP metadata"):
        load_metadata(pickle.dumps({"state_dict_metadata": {}}), path)
    with pytest.raises(UnsafeCheckpointError, match="is not readable DCP metadata"):
        load_metadata(pickle.dumps(torch.Size([3]))[:-4], path)  # truncated


def test_a_pickle_that_sets_attributes_of_an_allowed_class_is_refused(tmp_path):
    """BUILD on the class `Metadata` itself (not an instance) would change it for the whole process."""
    from torch.distributed.checkpoint.metadata import Metadata

    data = (b"ctorch.distributed.checkpoint.metadata\nMetadata\n"  # GLOBAL: the class
            b"N}X\x04\x00\x00\x00evilK\x01s\x86"  # (None, {"evil": 1}): set attribute `evil`
            b"b.")  # BUILD, STOP
    with pytest.raises(UnsafeCheckpointError, match="sets the state of a type"):
        load_metadata(data, str(tmp_path / ".metadata"))
    assert not hasattr(Metadata, "evil")


def test_a_storage_entry_outside_the_folder_is_refused(checkpoint):
    folder = checkpoint[0]
    path = metadata_path(folder)
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../elsewhere.distcp"
    with pytest.raises(UnsafeCheckpointError, match="not a file of its folder"):
        load_metadata(pickle.dumps(metadata), path)


def test_a_planted_non_tensor_value_in_a_shard_file_is_refused(tmp_path):
    """DCP's default planner loads non-tensor values (an optimizer's lr, betas) with weights_only=False."""
    marker = tmp_path / "payload-ran"
    folder = save({"optimizer": {"param_groups": [{"lr": Call(os.system, f"touch {marker}")}]}}, tmp_path / "opt")
    target = {"optimizer": {"param_groups": [{"lr": 0.1}]}}
    with pytest.raises(UnsafeCheckpointError, match="Refusing to load") as refused:
        read_dcp(target, folder)
    assert os.path.join(folder, "__0_0.distcp") in str(refused.value) and "optimizer.param_groups.0.lr" in str(
        refused.value)
    assert not marker.exists()


class StandInDeepSpeedEngine:
    """Loads `<checkpoint>/global_step1/mp_rank_00_model_states.pt` as DeepSpeed's TorchCheckpointEngine does."""

    def load_checkpoint(self, checkpoint, load_module_strict=True):
        self.loaded = torch.load(os.path.join(checkpoint, "global_step1", "mp_rank_00_model_states.pt"),
                                 map_location="cpu", weights_only=False)


def deepspeed_checkpoint(tmp_path, state) -> str:
    os.makedirs(tmp_path / "checkpoint" / "global_step1")
    torch.save(state, tmp_path / "checkpoint" / "global_step1" / "mp_rank_00_model_states.pt")
    return str(tmp_path / "checkpoint")


def test_a_deepspeed_checkpoint_of_tensors_and_plain_values_loads(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    state = {"module": tiny_model().state_dict(), "global_steps": 1, "ds_version": "0.18", "param_shapes": [
        {"0.weight": torch.Size([3, 4])}], "sparse_tensor_module_names": set(), "lr_scheduler": None}
    engine = StandInDeepSpeedEngine()
    load_deepspeed_checkpoint(engine, deepspeed_checkpoint(tmp_path, state))
    assert engine.loaded.keys() == state.keys() and engine.loaded["param_shapes"] == state["param_shapes"]
    assert all(torch.equal(engine.loaded["module"][k], v) for k, v in state["module"].items())
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ  # torch's switch is restored


def test_a_planted_deepspeed_checkpoint_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload-ran"
    checkpoint = deepspeed_checkpoint(tmp_path, {"module": {}, "client_state": Call(os.system, f"touch {marker}")})
    with pytest.raises(UnsafeCheckpointError, match="Refusing to load the DeepSpeed checkpoint") as refused:
        load_deepspeed_checkpoint(StandInDeepSpeedEngine(), checkpoint)
    assert checkpoint in str(refused.value) and "system" in str(refused.value)
    assert not marker.exists()
