"""Other libraries' private attributes (loopkit/private_api.py): on the installed torch / Accelerate / transformers,
each still exists and means what loopkit relies on, and no other module of loopkit touches one itself.

CI runs this file in the fast tier on the pinned, newest and oldest transformers / Accelerate, so it fails on the
version that renames or changes one. It starts no process: the worker-related names are checked on torch's classes
and source, and the queue clean-up on real multiprocessing queues (threads, no process).
"""

import ast
import importlib
import inspect
import multiprocessing
import pathlib
import warnings

import pytest
import torch

import loopkit
from loopkit import private_api

ROOT = pathlib.Path(loopkit.__file__).parent

# A private name loopkit uses in a file another session is changing: routed through private_api at merge.


def registered_names() -> set[str]:
    """Every private name PRIVATE_ATTRIBUTES lists."""
    return {name for entry in private_api.PRIVATE_ATTRIBUTES for name in entry.names}


def test_every_entry_says_why_and_what_happens_without_it():
    for entry in private_api.PRIVATE_ATTRIBUTES:
        assert entry.owner and entry.names and len(entry.why) > 10 and len(entry.if_missing) > 5, entry


def test_no_other_module_touches_a_registered_private_name():
    """`x._name`, `getattr(x, "_name")`, `vars(x).pop("_name")`, `from torch._dynamo... import`: only in
    loopkit/private_api.py."""
    found = set()
    for path in ROOT.rglob("*.py"):
        relative = str(path.relative_to(ROOT))
        if relative != "private_api.py":
            found |= {(relative, name) for name in private_names_used(ast.parse(path.read_text()))}
    assert not found, sorted(found)


def private_names_used(tree) -> set[str]:
    names, used = registered_names(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Name) and node.id.startswith("_"):  # an imported private class; not a local
            used.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.add(node.value)
        elif isinstance(node, ast.ImportFrom) and node.module:
            used |= set(node.module.split("."))
        elif isinstance(node, ast.alias):
            used |= set(node.name.split("."))
    return used & names


def test_the_scan_sees_each_kind_of_use():
    code = ("a._opt_called = True\ngetattr(b, '_non_blocking', False)\n"
            "from torch.distributed.checkpoint._traverse import set_element\nimport torch._dynamo\nx = y._own\n"
            "isinstance(info, _StorageInfo)\nfound_inf = watch.observe()\n")  # a local of that name is no use
    assert private_names_used(ast.parse(code)) == {"_opt_called", "_non_blocking", "_traverse", "_dynamo",
                                                   "_StorageInfo"}


# -- the data stage --
def test_a_dataloader_keeps_its_persistent_workers_iterator_in_iterator():
    from torch.utils.data import DataLoader
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    loader = DataLoader(list(range(4)))
    assert loader._iterator is None  # set by __iter__ only with persistent workers
    source = inspect.getsource(DataLoader.__iter__)
    assert "self.persistent_workers" in source and "self._iterator = self._get_iterator()" in source
    assert callable(_MultiProcessingDataLoaderIter._shutdown_workers)
    init = inspect.getsource(_MultiProcessingDataLoaderIter.__init__)
    assert "self._index_queues" in init and "self._worker_result_queue" in init


def test_shut_down_persistent_workers_stops_them_and_forgets_the_iterator():
    stopped = []

    class Iterator:
        _index_queues, _worker_result_queue = (), None

        def _shutdown_workers(self):
            stopped.append(True)

    class Loader:
        _iterator = Iterator()

    loader = Loader()
    private_api.shut_down_persistent_workers(loader)
    assert stopped == [True] and loader._iterator is None
    private_api.shut_down_persistent_workers(loader)  # nothing left to stop
    assert stopped == [True]


def test_the_worker_queues_pipes_are_closed_after_their_feeders_finish():
    """The queues as torch's `_shutdown_workers` leaves them: closed, a feeder maybe still flushing, the result
    queue's pipe open until the garbage collector comes."""
    index_queue, result_queue = multiprocessing.Queue(), multiprocessing.Queue()
    index_queue.put(1)  # starts the feeder thread, as torch's puts do
    for queue in (index_queue, result_queue):
        queue.cancel_join_thread()
        queue.close()
    assert index_queue._thread is not None and not result_queue._reader.closed

    class Iterator:
        _index_queues, _worker_result_queue = [index_queue], result_queue

    private_api.close_worker_queues(Iterator())
    for queue in (index_queue, result_queue):
        assert queue._reader.closed and queue._writer.closed
    assert not index_queue._thread.is_alive()


def test_a_prepared_loader_keeps_its_non_blocking_setting_in_non_blocking():
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    for non_blocking in (True, False):
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(non_blocking=non_blocking))
        loader = accelerator.prepare(DataLoader(list(range(4)), batch_size=2))
        assert private_api.non_blocking_copies(loader) is non_blocking
    assert private_api.non_blocking_copies(DataLoader(list(range(4)))) is False


# -- the step stage --
def scheduled_optimizer():
    """An Accelerate-prepared SGD and a LambdaLR built on it, as `StepStage.prepare` builds them."""
    from accelerate import Accelerator

    model = torch.nn.Linear(2, 1)
    optimizer = Accelerator(cpu=True).prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 2)).sum().backward()
    return optimizer, scheduler


def scheduler_warnings(scheduler) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    return [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]


def test_the_scheduler_reads_opt_called_which_the_direct_path_records():
    optimizer, scheduler = scheduled_optimizer()
    optimizer.optimizer.step()  # the direct path: the inner optimizer, which the scheduler did not wrap
    assert len(scheduler_warnings(scheduler)) == 1  # unrecorded: torch warns the scheduler stepped first
    optimizer, scheduler = scheduled_optimizer()
    optimizer.optimizer.step()
    private_api.record_optimizer_step(optimizer)
    assert scheduler_warnings(scheduler) == []
    optimizer, scheduler = scheduled_optimizer()
    optimizer.step()  # the scheduler's wrapper records the same attribute
    assert optimizer._opt_called is True and scheduler_warnings(scheduler) == []


def test_accelerates_sync_gradients_setter_sets_the_flag():
    from accelerate.state import GradientState

    state = GradientState()
    before = state.sync_gradients
    assert callable(state._set_sync_gradients)
    setter = private_api.sync_gradients_setter(state)
    try:
        for value in (False, True, False):
            setter(value)
            assert GradientState().sync_gradients is value
    finally:
        state.sync_gradients = before


def test_accelerate_marks_a_prepared_model_and_returns_a_marked_one_as_it_is():
    from accelerate import Accelerator

    model = torch.nn.Linear(2, 1)
    Accelerator(cpu=True).prepare(model)
    assert model._is_accelerate_prepared is True
    source = inspect.getsource(Accelerator.prepare_model)
    if "_is_accelerate_prepared" in source:  # newer Accelerate (1.15 here) returns a marked model as it is
        assert 'getattr(model, "_is_accelerate_prepared", False)' in source
    # else (1.13): prepare_model wraps whatever it gets, the documented fallback ("nothing to drop")
    private_api.forget_accelerate_prepared(model)
    assert "_is_accelerate_prepared" not in vars(model)
    private_api.forget_accelerate_prepared(model)  # not marked: nothing to drop


@pytest.mark.parametrize("found_inf,applied", [(1.0, False), (0.0, True)])
def test_a_fused_optimizer_skips_its_step_where_found_inf_is_one(found_inf, applied):
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.ones(3)
    private_api.skip_fused_step_if(optimizer, torch.tensor(found_inf))
    optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(3)) is not applied


def test_the_accelerator_lists_what_it_prepared_until_free_memory():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    assert not private_api.holds_prepared_objects(accelerator)
    for name in ("_models", "_optimizers", "_schedulers", "_dataloaders"):
        assert isinstance(getattr(accelerator, name), list), name
    model = torch.nn.Linear(2, 1)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert private_api.holds_prepared_objects(accelerator)
    accelerator.free_memory()
    assert not private_api.holds_prepared_objects(accelerator)


# -- Accelerate's process-wide state --
def test_accelerates_states_share_the_dictionaries_loopkit_saves_and_resets():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    shared = private_api.accelerate_shared_states()
    assert [type(d) for d in shared] and all(isinstance(d, dict) for d in shared)
    assert PartialState().__dict__ is shared[0] and GradientState().__dict__ is shared[2]
    assert "reset_partial_state" in inspect.signature(AcceleratorState._reset_state).parameters
    assert callable(GradientState._reset_state)


def test_parallelism_config_sets_a_size_and_validates_against_an_accelerator():
    from accelerate.parallelism_config import ParallelismConfig

    config = ParallelismConfig()
    assert config.total_size == 1
    private_api.set_parallel_size(config, "dp_replicate", 2)
    assert config.dp_replicate_size == 2 and config.total_size == 2
    assert list(inspect.signature(ParallelismConfig._validate_accelerator).parameters) == ["self", "accelerator"]


# -- torch --
def test_a_schedulers_last_lr_list_is_what_get_last_lr_returns():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    private_api.scheduler_last_lrs(scheduler).append(0.25)
    assert scheduler.get_last_lr() == [0.05, 0.25]
    assert private_api.scheduler_last_lrs(object()) is None


def test_a_modules_own_parameters_leave_its_childrens_out():
    model = torch.nn.Sequential(torch.nn.Linear(2, 1))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    assert private_api.own_parameter_names(model) == ["scale"]
    assert private_api.own_parameter_names(model[0]) == ["weight", "bias"]


def test_a_compiled_wrapper_holds_its_module_in_orig_mod():
    model = torch.nn.Linear(2, 1)
    compiled = torch.compile(model)  # a wrapper; nothing is compiled before its first call
    assert private_api.compiled_module(compiled) is compiled and private_api.compiled_module(model) is None
    assert private_api.original_module(compiled) is model
    other = torch.nn.Linear(2, 1)
    private_api.set_original_module(compiled, other)
    assert private_api.original_module(compiled) is other


def test_dynamos_callback_handler_registers_and_removes_callbacks():
    handler, trigger = private_api.dynamo_callbacks()
    for method in ("register_start_callback", "register_end_callback", "remove_start_callback",
                   "remove_end_callback"):
        assert callable(getattr(handler, method)), method
    assert trigger.name == "DYNAMO"


def test_torchs_layout_lookup_and_dcps_set_element_and_pickled_classes():
    import dataclasses

    assert private_api.torch_layout_lookup()("torch.strided") is torch.strided
    info = private_api.dcp_storage_info_class()
    assert {"relative_path", "offset", "length"} <= {f.name for f in dataclasses.fields(info)}
    for (module, name), found in private_api.dcp_private_classes().items():
        assert getattr(importlib.import_module(module), name) is found, (module, name)
    root = {"model": {}}
    private_api.dcp_set_element()(root, ("model", "layer", 0), 7)
    assert root == {"model": {"layer": [7]}}


# -- transformers --
def test_a_generation_config_from_the_model_config_gets_hfs_defaults_filled():
    from transformers import GenerationConfig, GPT2Config

    config = GenerationConfig.from_model_config(GPT2Config(n_layer=1, n_embd=8, n_head=2))
    assert config._from_model_config is True
    private_api.fill_generation_defaults(config)
    assert config._from_model_config is False and config.max_length == 20


def test_a_models_config_names_its_attention_implementation():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, attn_implementation="eager")
    assert private_api.attention_implementation(LlamaForCausalLM(config).config) == "eager"


def test_training_arguments_dict_fields_are_its_fields():
    import dataclasses

    from transformers import TrainingArguments

    fields = private_api.training_arguments_dict_fields()
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert "lr_scheduler_kwargs" in fields and set(fields) <= names
    assert private_api.TRAINING_ARGUMENTS_DICT_FIELDS == "_VALID_DICT_FIELDS"


def test_a_seeded_collator_records_the_process_that_owns_its_generator():
    import os

    from transformers import DataCollatorForLanguageModeling

    class Tokenizer:  # what the collator reads of a tokenizer when masking is off
        pad_token, mask_token = "<pad>", None

    collator = DataCollatorForLanguageModeling(Tokenizer(), mlm=False, seed=3)
    records_owner = "_generator_pid" in vars(collator)  # transformers 5.24 on; 5.23 keeps the generator alone
    assert collator.generator is None and (not records_owner or collator._generator_pid is None)
    create_rng = collator.create_rng  # 5.24 on: create_rng(return_tensors); 5.23: create_rng()
    create_rng(*(["pt"] if inspect.signature(create_rng).parameters else []))
    assert isinstance(collator.generator, torch.Generator)
    assert not records_owner or collator._generator_pid == os.getpid()
    # loopkit keeps (columns.py) those of COLLATOR_GENERATOR_ATTRIBUTES the collator has: the generator always
    assert "generator" in vars(collator) and set(private_api.COLLATOR_GENERATOR_ATTRIBUTES) <= set(vars(collator)) | (
        set() if records_owner else {"_generator_pid"})
