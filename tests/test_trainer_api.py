"""Every public name of `transformers.Trainer` resolves on `Loop` and behaves as on a Trainer (run live here): the
walk over `dir(Trainer)` and `vars(Trainer(...))`, the result files of `log_metrics`/`save_metrics`/`save_state`,
HF's hooks called where Trainer calls them, `push_to_hub` without a Hub, `hyperparameter_search`, and the behaviours
of transformers' own `tests/trainer/test_trainer_callback.py` not already covered by test_hf_callbacks.py and
test_event_parity.py.
"""

import importlib.util
import inspect
import json
import math
import os
import re
import warnings

import pytest
import torch
from transformers import (DefaultFlowCallback, EarlyStoppingCallback, PrinterCallback, ProgressCallback, Trainer,
                          TrainerCallback)

from transformers.trainer_callback import ExportableState

from loopkit import Loop, LoopConfigError, LoopState
from loopkit.state import restore_callback_states

from helpers import (IGNORE_PIN_MEMORY_WARNING, Recorder, hf_args, lm_data, regression_data, runners, tiny_llama,
                     tiny_regression)

pytestmark = IGNORE_PIN_MEMORY_WARNING

TIMING = ("_runtime", "_per_second")


def build(runner, tmp_path, name, callbacks=None, train_size=16, **arg_kwargs):
    args = hf_args(tmp_path / name, **arg_kwargs)
    return runner(tiny_regression(), args, train_dataset=regression_data(train_size),
                  eval_dataset=regression_data(8, seed=1), callbacks=callbacks)


def without_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMING)}


# ---------------------------------------------------------------------------------------------------------------
# Every public name
# ---------------------------------------------------------------------------------------------------------------
def test_every_public_trainer_name_resolves_on_loop_with_trainers_signature(tmp_path):
    """A name a later transformers release adds to Trainer (class or constructed instance) fails this test."""
    public = [name for name in dir(Trainer) if not name.startswith("_")]
    assert len(public) >= 48
    missing = [name for name in public if not hasattr(Loop, name)]
    assert missing == [], f"Trainer names absent on Loop: {missing}"
    for name in public:
        hf_attr = getattr(Trainer, name)
        if not callable(hf_attr) or isinstance(inspect.getattr_static(Trainer, name), property):
            continue
        hf_params = [p for p in inspect.signature(hf_attr).parameters.values()]
        lk_params = [p for p in inspect.signature(getattr(Loop, name)).parameters.values()
                     if p.kind != p.VAR_KEYWORD or any(q.kind == q.VAR_KEYWORD for q in hf_params)]
        if name == "__init__":
            continue
        assert [p.name for p in lk_params] == [p.name for p in hf_params], f"Loop.{name} signature differs"
        assert [p.default for p in lk_params] == [p.default for p in hf_params], f"Loop.{name} defaults differ"

    hf = build(Trainer, tmp_path, "hf")
    lk = build(Loop, tmp_path, "loopkit")
    hf_names = [name for name in vars(hf) if not name.startswith("_")]
    assert len(hf_names) >= 38
    absent = [name for name in hf_names if not hasattr(lk, name)]
    assert absent == [], f"attributes of a constructed Trainer absent on a Loop: {absent}"
    for name in hf_names:  # plain values must agree (objects differ by class: Accelerator, handler, state, ...)
        value = getattr(hf, name)
        if value is None or isinstance(value, (bool, int, float, str)):
            assert getattr(lk, name) == value, f"{name}: loopkit {getattr(lk, name)!r} vs HF {value!r}"


def test_methods_agree_with_trainer(tmp_path, capsys):
    """The helpers that need no Hub, called on a Trainer and a Loop built alike, before and after training."""
    results = {}
    for name, runner in runners():
        trainer = build(runner, tmp_path, name, max_steps=3, per_device_train_batch_size=4,
                        gradient_accumulation_steps=2, save_strategy="no")
        with pytest.raises(ValueError, match="optimizer"):
            trainer.get_learning_rates()
        loader = trainer.get_train_dataloader()
        before = (trainer.get_num_trainable_parameters(), trainer.num_examples(loader),
                  trainer.get_total_train_batch_size(trainer.args), trainer.get_sp_size(), trainer.get_cp_size(),
                  trainer.get_tp_size(), trainer.set_initial_training_values(trainer.args, loader),
                  trainer.is_in_train)
        seen_in_train = []
        trainer.add_callback(type("InTrain", (TrainerCallback,), {
            "on_step_end": lambda self, *a, **k: seen_in_train.append(trainer.is_in_train)}))
        trainer.train()
        weight = trainer.model.linear.weight
        group = trainer.get_optimizer_group(weight)
        results[name] = dict(before=before, in_train=seen_in_train, after=trainer.is_in_train,
                             lrs=trainer.get_learning_rates(), group_lr=group["lr"],
                             groups=[len(g) for g in trainer.get_optimizer_group()],
                             cls_kwargs=trainer.get_optimizer_cls_and_kwargs(trainer.args))
    assert results["hf"]["before"][6] == (2, 2, 16, 24, 8, 4, 3)  # 16 samples, batch 4, GA 2, max_steps 3
    assert results["hf"]["in_train"] == [True] * 3
    assert results["loopkit"] == results["hf"]
    assert Loop.metrics_format({"train_runtime": 75.5, "loss": 0.123456, "total_flos": 3 << 30}) == \
        {"train_runtime": "0:01:15.50", "loss": 0.1235, "total_flos": "3GF"}


def test_optimizer_scheduler_and_hooks_called_directly(tmp_path):
    results = {}
    for name, runner in runners():
        trainer = build(runner, tmp_path, name, learning_rate=0.01, warmup_steps=2)
        trainer.create_optimizer_and_scheduler(num_training_steps=10)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model = trainer.call_model_init() if trainer.model_init is not None else None
        with trainer.compute_loss_context_manager(), trainer.autocast_smart_context_manager():
            pass
        results[name] = (trainer.get_learning_rates(), type(trainer.lr_scheduler).__name__, model)
    assert results["hf"] == ([0.005, 0.005], "LambdaLR", None)  # warmup: half the learning rate after one step
    assert results["loopkit"] == results["hf"]


def test_get_batch_samples_counts_items_as_trainer(tmp_path):
    """HF's `get_batch_samples` on a causal LM: the same batches and the same (shifted) label-token count."""
    counts = {}
    for name, runner in runners():
        trainer = runner(tiny_llama(), hf_args(tmp_path / name, per_device_train_batch_size=2),
                         train_dataset=lm_data(8))
        batches, num_items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 3, torch.device("cpu"))
        counts[name] = (len(batches), int(num_items), [b["input_ids"].tolist() for b in batches])
    assert counts["hf"][1] > 0
    assert counts["loopkit"] == counts["hf"]


def test_result_files_and_log_metrics_as_trainer_writes_them(tmp_path, capsys):
    """train/eval metrics through `log_metrics`, `save_metrics` and `save_state`: the same files, keys and values
    (timings aside), and the same printed table."""
    printed = {}
    for name, runner in runners():
        trainer = build(runner, tmp_path, name, max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                        eval_strategy="steps", eval_steps=2, save_strategy="no")
        capsys.readouterr()
        metrics = trainer.train().metrics
        metrics["train_samples"] = 16
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        metrics = trainer.evaluate()
        metrics["eval_samples"] = 8
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        trainer.save_metrics("test", {"test_x": 1.5}, combined=False)
        printed[name] = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\*{5} |  \w+ +=", line)
                         and "runtime" not in line and "per_second" not in line]
    assert_same_result_files(tmp_path / "loopkit", tmp_path / "hf", rtol=1e-6)
    with open(tmp_path / "hf" / "all_results.json") as f:
        assert "test_x" not in json.load(f)  # combined=False: test_results.json only
    assert printed["hf"] and printed["loopkit"] == printed["hf"]


RESULT_FILES = ("all_results.json", "train_results.json", "eval_results.json", "test_results.json",
                "predict_results.json", "trainer_state.json")


def assert_same_result_files(lk_dir, hf_dir, rtol, expected_ratio=None, expected_log_ratio=None):
    """The result files of two output folders: the same set, the same keys, numbers equal within `rtol` (timings
    and `total_flos` aside). `expected_ratio` maps a key to the loopkit/HF ratio it must have instead, and
    `expected_log_ratio` to the ratio of the values' logarithms (perplexity = exp(loss))."""
    found = [f for f in RESULT_FILES if os.path.exists(os.path.join(hf_dir, f))]
    assert "all_results.json" in found and "trainer_state.json" in found
    assert [f for f in RESULT_FILES if os.path.exists(os.path.join(lk_dir, f))] == found
    for file_name in found:
        with open(os.path.join(hf_dir, file_name)) as f:
            hf_text = f.read()
        with open(os.path.join(lk_dir, file_name)) as f:
            lk_text = f.read()
        hf_data, lk_data = json.loads(hf_text), json.loads(lk_text)
        assert list(lk_data) == list(hf_data), file_name  # sorted keys, as HF writes them
        if file_name == "trainer_state.json":
            assert len(lk_data["log_history"]) == len(hf_data["log_history"])
            pairs = [(f"log_history[{i}]", lk, hf) for i, (lk, hf) in
                     enumerate(zip(lk_data["log_history"], hf_data["log_history"]))]
            top = {k: v for k, v in hf_data.items() if k not in ("log_history", "total_flos")}
            assert {k: lk_data[k] for k in top} == top
        else:
            pairs = [(file_name, lk_data, hf_data)]
            assert lk_text.count("\n") == hf_text.count("\n")  # indent=4, one key a line
        for where, lk, hf in pairs:
            assert list(lk) == list(hf), where
            for key, value in hf.items():
                if key.endswith(TIMING) or key == "total_flos":
                    continue
                ratio = (expected_ratio or {}).get(key, 1.0)
                if key in (expected_log_ratio or {}):
                    lk_value, value, ratio = math.log(lk[key]), math.log(value), expected_log_ratio[key]
                    assert abs(lk_value - ratio * value) <= rtol * abs(ratio * value), f"{where} log {key}"
                elif isinstance(value, float):
                    assert abs(lk[key] - ratio * value) <= rtol * abs(ratio * value), \
                        f"{where} {key}: loopkit {lk[key]!r} vs HF {value!r} x {ratio}"
                else:
                    assert lk[key] == value, f"{where} {key}: loopkit {lk[key]!r} vs HF {value!r}"


# ---------------------------------------------------------------------------------------------------------------
# Hooks: called where Trainer calls them, or refused when overridden
# ---------------------------------------------------------------------------------------------------------------
def counting_subclass(base):
    class Counting(base):
        calls = None

        def count(self, name):
            type(self).calls[name] = type(self).calls.get(name, 0) + 1

        def call_model_init(self, trial=None):
            self.count("call_model_init")
            return super().call_model_init(trial)

        def create_accelerator_and_postprocess(self):
            self.count("create_accelerator_and_postprocess")
            return super().create_accelerator_and_postprocess()

        def autocast_smart_context_manager(self, cache_enabled=True):
            self.count("autocast_smart_context_manager")
            return super().autocast_smart_context_manager(cache_enabled)

        @staticmethod
        def get_optimizer_cls_and_kwargs(args, model=None):
            Counting.calls["get_optimizer_cls_and_kwargs"] = Counting.calls.get("get_optimizer_cls_and_kwargs", 0) + 1
            return base.get_optimizer_cls_and_kwargs(args, model)

    Counting.calls = {}
    return Counting


def test_overridden_hooks_are_called_where_trainer_calls_them(tmp_path):
    calls = {}
    for name, runner in runners():
        subclass = counting_subclass(runner)
        trainer = subclass(model_init=lambda: tiny_regression(), args=hf_args(tmp_path / name, max_steps=3,
                                                                     per_device_train_batch_size=4,
                                                                     eval_strategy="steps", eval_steps=2,
                                                                     per_device_eval_batch_size=4,
                                                                     save_strategy="no"),
                           train_dataset=regression_data(16), eval_dataset=regression_data(8, seed=1))
        trainer.train()
        trainer.predict(regression_data(4, seed=2))
        calls[name] = dict(subclass.calls)
    # HF: construction and train() each build a model; one autocast context per forward (3 steps, 2 evaluations
    # of 2 batches, 1 prediction batch); one optimizer lookup.
    assert calls["hf"] == {"create_accelerator_and_postprocess": 1, "call_model_init": 2,
                           "autocast_smart_context_manager": 8, "get_optimizer_cls_and_kwargs": 1}
    assert calls["loopkit"] == calls["hf"]


@pytest.mark.parametrize("hook,instead", [("get_batch_samples", "DataStage.windows"),
                                          ("set_initial_training_values", "DataStage.plan")])
def test_overriding_a_hook_loopkit_does_not_call_is_refused(hook, instead):
    with pytest.raises(TypeError, match=rf"overrides Trainer.{hook}.*{instead}"):
        type("MyLoop", (Loop,), {hook: lambda self, *args: None})


def test_set_initial_training_values_refuses_other_args_and_end_ends_accelerate(tmp_path):
    loop = build(Loop, tmp_path, "loopkit")
    loader = loop.get_train_dataloader()  # first: building TrainingArguments resets Accelerate's shared state
    with pytest.raises(ValueError, match="loop.args"):
        loop.set_initial_training_values(hf_args(tmp_path / "other"), loader)
    ended = []
    loop.accelerator.end_training = lambda: ended.append(True)  # the real one tears down Accelerate's process state
    loop.end()
    assert ended == [True]


# ---------------------------------------------------------------------------------------------------------------
# The Hub, the model card, the hyper-parameter search
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hub", ["offline_mode", "unreachable_endpoint"])
def test_push_to_hub_without_a_hub_raises_at_once(tmp_path, monkeypatch, hub):
    import socket

    from huggingface_hub import HfApi, constants

    from loopkit.trainer.hub import HUB_TIMEOUT_S

    if hub == "offline_mode":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        reason = "HF_HUB_OFFLINE"
    else:  # nothing listens on port 9 of this machine: the connection is refused
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
        reason = "no connection to 127.0.0.1:9"
    recorder = Recorder()
    loop = build(Loop, tmp_path, "loopkit", callbacks=[recorder])
    # "At once": one bounded connection attempt (none offline), and no call to the Hub's API, whose retries wait.
    attempts, connect = [], socket.create_connection

    def counted_connect(address, timeout, *args):
        attempts.append((address, timeout))
        return connect(address, timeout, *args)

    monkeypatch.setattr(socket, "create_connection", counted_connect)
    for method in ("create_repo", "upload_folder"):
        monkeypatch.setattr(HfApi, method, lambda *a, **k: pytest.fail("the Hub's API was called"))
    with pytest.raises(ConnectionError, match=rf"push_to_hub: .*not reachable: {reason}.*Fix: .*save_model"):
        loop.push_to_hub()
    assert attempts == ([] if hub == "offline_mode" else [(("127.0.0.1", 9), HUB_TIMEOUT_S)])
    assert [event[0] for event in recorder.events] == ["on_init_end", "on_push_begin"]  # fired first, as in HF
    with pytest.raises(ConnectionError, match="init_hf_repo"):
        loop.init_hf_repo()


def test_create_model_card_as_trainer(tmp_path):
    cards = {}
    for name, runner in runners():
        args = hf_args(tmp_path / name, max_steps=2, per_device_train_batch_size=4, eval_strategy="steps",
                       eval_steps=2, save_strategy="no")
        trainer = runner(tiny_llama(), args, train_dataset=lm_data(8), eval_dataset=lm_data(4, seed=1))
        trainer.train()
        trainer.create_model_card(model_name="tiny", tasks="text-classification")
        with open(tmp_path / name / "README.md") as f:
            cards[name] = [line for line in f.read().splitlines() if "Runtime" not in line and "|" not in line]
    assert any("generated_from_trainer" in line for line in cards["hf"])
    assert cards["loopkit"] == cards["hf"]


def test_hyperparameter_search_without_optuna_raises(tmp_path):
    if importlib.util.find_spec("optuna") is not None:
        pytest.skip("optuna is installed: test_hyperparameter_search_as_trainer runs instead")
    loop = Loop(model_init=lambda: tiny_regression(), args=hf_args(tmp_path), train_dataset=regression_data(8))
    with pytest.raises(ImportError, match="pip install optuna"):
        loop.hyperparameter_search(n_trials=1)
    with pytest.raises(LoopConfigError, match="backend='ray'.*optuna backend only"):
        loop.hyperparameter_search(backend="ray")


def test_hyperparameter_search_as_trainer(tmp_path):
    """HF's optuna backend and loopkit's, same seeded sampler: the same trials, objectives and best run."""
    optuna = pytest.importorskip("optuna", reason="optuna is optional (pip install optuna)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def hp_space(trial):
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-1, log=True)}

    results = {}
    for name, runner in runners():
        trainer = runner(model_init=lambda: tiny_regression(),
                         args=hf_args(tmp_path / name, max_steps=4, per_device_train_batch_size=4,
                                      eval_strategy="steps", eval_steps=2, save_steps=4),
                         train_dataset=regression_data(16), eval_dataset=regression_data(8, seed=1))
        best = trainer.hyperparameter_search(hp_space=hp_space, n_trials=3, direction="minimize",
                                             sampler=optuna.samplers.TPESampler(seed=0))
        checkpoints = sorted(os.path.relpath(os.path.join(folder, sub), tmp_path / name)
                             for folder, subs, _ in os.walk(tmp_path / name) for sub in subs
                             if sub.startswith("checkpoint-"))
        results[name] = (best.run_id, best.objective, best.hyperparameters, trainer.hp_search_backend,
                         trainer.state.trial_params, checkpoints)
    assert results["hf"][3] is None  # the backend is unset after the search
    assert set(results["hf"][4]) == {"learning_rate"}  # state.trial_params: the last trial's
    assert results["hf"][5] == ["run-0/checkpoint-4", "run-1/checkpoint-4", "run-2/checkpoint-4"]
    assert results["loopkit"][:1] == results["hf"][:1] and results["loopkit"][2:] == results["hf"][2:]
    assert results["loopkit"][1] == pytest.approx(results["hf"][1], rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# transformers' callback tests, with Loop
# ---------------------------------------------------------------------------------------------------------------
def callback_names(trainer) -> list[str]:
    """Sorted class names, as transformers' get_callback_names."""
    return sorted(type(cb).__name__ for cb in trainer.callback_handler.callbacks)


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_default_callbacks_under_hf_class_names(tmp_path, disable_tqdm):
    names = {name: callback_names(build(runner, tmp_path, name, callbacks=[Recorder], disable_tqdm=disable_tqdm))
             for name, runner in runners()}
    progress = "PrinterCallback" if disable_tqdm else "ProgressCallback"
    assert names["hf"] == sorted(["DefaultFlowCallback", progress, "Recorder"])
    assert names["loopkit"] == names["hf"]


def test_add_pop_and_remove_callbacks_by_class_and_instance(tmp_path):
    lists = {}
    for name, runner in runners():
        trainer = build(runner, tmp_path, name, disable_tqdm=False)
        handler = trainer.callback_handler
        trainer.add_callback(Recorder)  # by class: instantiated
        assert isinstance(handler.callbacks[-1], Recorder)
        recorder = Recorder()
        trainer.add_callback(recorder)  # by instance: that very object
        assert handler.callbacks[-1] is recorder
        default_flow = next(cb for cb in handler.callbacks if type(cb).__name__ == "DefaultFlowCallback")
        assert trainer.pop_callback(DefaultFlowCallback) is default_flow  # HF's class finds loopkit's callback
        assert trainer.pop_callback(DefaultFlowCallback) is None
        trainer.remove_callback(ProgressCallback)  # was a silent no-op on a Loop
        trainer.remove_callback(recorder)
        with pytest.raises(ValueError):
            trainer.remove_callback(recorder)
        trainer.add_callback(PrinterCallback)
        trainer.remove_callback(PrinterCallback)
        lists[name] = callback_names(trainer)
    assert lists["hf"] == ["Recorder"]
    assert lists["loopkit"] == lists["hf"]


def test_duplicate_callback_warns_naming_it(tmp_path):
    with pytest.warns(UserWarning, match="Recorder"):
        build(Loop, tmp_path, "loopkit", callbacks=[Recorder, Recorder])
    loop = build(Loop, tmp_path, "loopkit")
    with pytest.warns(UserWarning, match="PrinterCallback"):  # HF's class duplicates loopkit's printer
        loop.add_callback(PrinterCallback)


def test_on_push_begin_and_call_event_through_the_handler(tmp_path):
    """transformers' test_on_push_begin_event, and `call_event` (no flag reset) vs `on_<event>` (reset first)."""
    recorders = {}
    for name, runner in runners():
        recorder = Recorder()
        trainer = build(runner, tmp_path, name, callbacks=[recorder], max_steps=1, save_strategy="no")
        trainer.train()
        handler, before = trainer.callback_handler, len(recorder.events)
        handler.on_push_begin(trainer.args, trainer.state, trainer.control)
        trainer.control.should_log = True
        handler.call_event("on_step_begin", trainer.args, trainer.state, trainer.control)
        control = handler.on_step_begin(trainer.args, trainer.state, trainer.control)
        recorders[name] = (recorder.events[before:], control.should_log)
    assert [event[0] for event in recorders["hf"][0]] == ["on_push_begin", "on_step_begin", "on_step_begin"]
    assert [event[3] for event in recorders["hf"][0]][1:] == ["LT", "T"]  # call_event keeps should_log
    assert recorders["loopkit"] == recorders["hf"]


def stateful_run(runner, output_dir, callbacks, **extra):
    args = hf_args(output_dir, max_steps=2, save_steps=2, eval_strategy="steps", eval_steps=2,
                   per_device_train_batch_size=8, metric_for_best_model="loss", **extra)
    return runner(tiny_regression(), args, train_dataset=regression_data(16), eval_dataset=regression_data(8, seed=1),
                  callbacks=callbacks)


class Stateful(TrainerCallback, ExportableState):
    """transformers' StatefulTestCallback."""

    def __init__(self, my_value="default"):
        self.my_value = my_value

    def state(self):
        return {"args": {"my_value": self.my_value}, "attributes": {}}


def test_missing_stateful_callback_warns_and_duplicates_restore_in_order(tmp_path):
    """transformers' test_missing_stateful_callback_warning and test_multiple_instances_of_same_stateful_callback."""
    restored = {}
    for name, runner in runners():
        stateful_run(runner, tmp_path / name, [Stateful("first"), Stateful("second"),
                                               EarlyStoppingCallback(early_stopping_patience=5)]).train()
        checkpoint = str(tmp_path / name / "checkpoint-2")
        trainer = stateful_run(runner, tmp_path / name, [Stateful(), Stateful()],
                               restore_callback_states_from_checkpoint=True)
        if name == "loopkit":
            with pytest.warns(UserWarning, match=r"Checkpoint included callbacks not included.*EarlyStoppingCallback"):
                trainer.train(resume_from_checkpoint=checkpoint)
        else:
            trainer.train(resume_from_checkpoint=checkpoint)
        restored[name] = [cb.my_value for cb in trainer.callback_handler.callbacks if isinstance(cb, Stateful)]
    assert restored["hf"] == ["first", "second"]
    assert restored["loopkit"] == restored["hf"]


def test_control_state_restored_from_checkpoint(tmp_path):
    """transformers' test_trainer_control_state_persists: the saved TrainerControl comes back into `control`."""
    stateful_run(Loop, tmp_path, None).train()
    loop = stateful_run(Loop, tmp_path, None, restore_callback_states_from_checkpoint=True)
    assert not loop.control.should_training_stop
    loop.state = LoopState.load_from_json(str(tmp_path / "checkpoint-2" / "trainer_state.json"))
    restore_callback_states(loop.callback_handler.callbacks + [loop.control], loop.state.stateful_callbacks)
    assert loop.control.should_training_stop


class StopAfter(TrainerCallback):
    def __init__(self, steps):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.steps:
            control.should_training_stop = True
        return control


class FlagLog(TrainerCallback):
    """Counts saves requested at step and epoch ends, and records the flags seen at each step end."""

    def __init__(self):
        self.saves, self.flags = 0, []

    def on_step_end(self, args, state, control, **kwargs):
        self.saves += control.should_save
        self.flags.append((state.global_step, control.should_log, control.should_save, control.should_evaluate))

    def on_epoch_end(self, args, state, control, **kwargs):
        self.saves += control.should_save


def test_control_flow_callbacks_as_trainer(tmp_path):
    """transformers' test_no_duplicate_save_on_epoch_strategy, test_callback_can_stop_training and
    test_callback_receives_control_flags."""
    seen = {}
    for name, runner in runners():
        flags = FlagLog()
        build(runner, tmp_path, f"{name}-epoch", callbacks=[flags], max_steps=2, save_strategy="epoch").train()
        stopped = build(runner, tmp_path, f"{name}-stop", callbacks=[StopAfter(1)], max_steps=10, logging_steps=1,
                        save_strategy="no")
        stopped.train()
        logged = FlagLog()
        build(runner, tmp_path, f"{name}-flags", callbacks=[logged], max_steps=2, logging_steps=1,
              save_strategy="no").train()
        seen[name] = (flags.saves, stopped.state.global_step, logged.flags)
    assert seen["hf"][:2] == (1, 1) and len(seen["hf"][2]) == 2
    assert seen["loopkit"] == seen["hf"]
