"""Step observers (loopkit/observers/): each optimizer step's result in, keys added to the training logs out, before
log_history, the report_to integrations, the printer, user callbacks and the run report see them.

The proof is `loopkit.observers.throughput.Throughput` (real tokens per second and the padding share) on real
Rotten Tomatoes reviews, tokenized by MiniLM's tokenizer and padded per batch by HF's `DataCollatorWithPadding`
(`BatchEncoding` batches, an uneven last batch), with TensorBoard as the `report_to` integration.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding, TrainerCallback

from helpers import hf_args, minilm_tokenizer, regression_data, rotten_tomatoes, tiny_regression
from loopkit import Loop, LoopConfigError
from loopkit.observers import StepObserver
from loopkit.observers.throughput import Throughput
from test_docs import readme_inputs  # noqa: F401 (the fixture the docs examples start from)

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `benchmarks/` lives in the repository, next to the installed loopkit
    sys.path.insert(0, str(REPO_ROOT))


def reviews(tokenizer, n: int) -> list[dict]:
    return [{**tokenizer(text, truncation=True, max_length=48), "labels": label} for text, label in rotten_tomatoes(n)]


def tiny_bert(tokenizer):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)
    return BertForSequenceClassification(config)


class WindowLedger(StepObserver):
    """The test's own account of every window: main-input tokens, padding (read now: a test may sync), seconds."""

    def __init__(self):
        self.windows, self.logged_at = [], []

    def on_step(self, result, window, state):
        padding = sum(int((batch["attention_mask"] == 0).sum()) for batch in window.batches)
        real = sum(int(batch["attention_mask"].sum()) for batch in window.batches)
        self.windows.append({"step": state.global_step, "tokens": result.tokens, "padding": padding, "real": real,
                             "seconds": result.seconds, "completed": result.completed})

    def logs(self, state):
        self.logged_at.append(len(self.windows))
        return {}


class LogKeys(TrainerCallback):
    """What a user's callback receives in `on_log`."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_throughput_keys_reach_log_history_tensorboard_the_printer_callbacks_and_the_report(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from loopkit import report
    from loopkit.report import chart_figure

    tokenizer = minilm_tokenizer()
    train = reviews(tokenizer, 22)  # batches of 3 (the last of 1), 2 per window: 4 windows an epoch
    ledger, user = WindowLedger(), LogKeys()
    args = hf_args(tmp_path / "run", per_device_train_batch_size=3, gradient_accumulation_steps=2,
                   num_train_epochs=2, logging_steps=2, save_strategy="no", report_to="tensorboard")
    loop = Loop(model=tiny_bert(tokenizer), args=args, train_dataset=train,
                data_collator=DataCollatorWithPadding(tokenizer), callbacks=[user],
                observers=[ledger, Throughput()])
    loop.train()

    # Every sample's real tokens, counted once an epoch: the ledger's windows add up to the dataset.
    assert all(w["completed"] for w in ledger.windows) and len(ledger.windows) == loop.state.global_step == 8
    assert sum(w["real"] for w in ledger.windows) == 2 * sum(len(s["input_ids"]) for s in train)
    assert all(w["tokens"] == w["real"] + w["padding"] and w["seconds"] > 0 for w in ledger.windows)
    assert sum(w["padding"] for w in ledger.windows) > 0  # reviews differ in length: there is padding to count

    training_logs = [h for h in loop.state.log_history if "loss" in h]
    assert [h["step"] for h in training_logs] == [2, 4, 6, 8]
    assert ledger.logged_at == [2, 4, 6, 8]  # logs() ran at each training log, and only there
    for log, since in zip(training_logs, ([w for w in ledger.windows if 2 * i < w["step"] <= 2 * i + 2]
                                          for i in range(4))):
        tokens, padding = sum(w["tokens"] for w in since), sum(w["padding"] for w in since)
        seconds = sum(w["seconds"] for w in since)
        assert log["padding_share"] == pytest.approx(padding / tokens, abs=1e-4)
        assert log["real_tokens_per_second"] == pytest.approx((tokens - padding) / seconds, rel=1e-3)
    # Evaluation and summary logs are not training logs: no observer keys there.
    assert "padding_share" not in loop.state.log_history[-1]

    # The user's callback and HF's printer saw the keys in the same log.
    assert [log["padding_share"] for log in user.logs if "loss" in log] == [h["padding_share"] for h in training_logs]
    assert "'real_tokens_per_second':" in capsys.readouterr().out

    # HF's TensorBoardCallback wrote them (as train/<key>) at each training log's step.
    (event_file,) = glob.glob(str(tmp_path / "run" / "runs" / "**" / "events.out.tfevents.*"),
                                recursive=True)
    events = EventAccumulator(event_file)
    events.Reload()
    for key in ("real_tokens_per_second", "padding_share"):
        scalars = events.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [2, 4, 6, 8]
        assert [s.value for s in scalars] == pytest.approx([h[key] for h in training_logs], rel=1e-6)

    # The run report charts them: one axis per added key (drawn by `python -m loopkit report`).
    assert "step_metrics.png" in report.chart_names(loop.report)
    assert report.main(["report", str(tmp_path / "run")]) == 0
    assert os.path.getsize(tmp_path / "run" / "step_metrics.png") > 0
    axes = chart_figure("step_metrics.png", loop.report).axes
    assert [ax.get_ylabel() for ax in axes] == ["real_tokens_per_second", "padding_share"]
    assert list(axes[1].get_lines()[0].get_ydata()) == [h["padding_share"] for h in training_logs]


class Order(StepObserver, TrainerCallback):
    """Where `on_step` and `logs` run among the events (the same object is a callback too)."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(("on_step_end", state.global_step))

    def on_step(self, result, window, state):
        self.seen.append(("on_step", state.global_step))

    def logs(self, state):
        self.seen.append(("logs", state.global_step))
        return {"steps_seen": sum(1 for name, _ in self.seen if name == "on_step")}

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(("on_log", state.global_step))


def test_on_step_runs_after_each_step_and_logs_before_on_log(tmp_path):
    order = Order()
    args = hf_args(tmp_path, per_device_train_batch_size=4, max_steps=5, logging_steps=2, save_strategy="no")
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32), callbacks=[order],
                observers=[order])
    loop.train()
    expected = []
    for step in range(1, 6):
        expected += [("on_step_end", step), ("on_step", step)]
        if step % 2 == 0:
            expected += [("logs", step), ("on_log", step)]
    expected += [("on_log", 5)]  # the summary log: no observer keys
    assert order.seen == expected
    assert [h["steps_seen"] for h in loop.state.log_history if "loss" in h] == [2, 4]


def test_no_observer_means_trainers_log_keys(tmp_path):
    args = hf_args(tmp_path, per_device_train_batch_size=4, max_steps=2, logging_steps=1, save_strategy="no")
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(16))
    loop.train()
    assert loop.schedule.observers == []
    assert [sorted(h) for h in loop.state.log_history if "loss" in h] == \
        [["epoch", "grad_norm", "learning_rate", "loss", "step"]] * 2


def test_the_throughput_observer_reads_the_device_only_at_logs(tmp_path):
    """One host read per training log (its padding count), none per step."""
    from benchmarks.harness.syncs import HostReadCounter

    class Counted(Throughput):
        def on_step(self, result, window, state):
            counter.active = True
            super().on_step(result, window, state)
            counter.active = False

    tokenizer = minilm_tokenizer()
    args = hf_args(tmp_path, per_device_train_batch_size=4, max_steps=4, logging_steps=2, save_strategy="no")
    with HostReadCounter() as counter:
        Loop(model=tiny_bert(tokenizer), args=args, train_dataset=reviews(tokenizer, 16),
             data_collator=DataCollatorWithPadding(tokenizer), observers=[Counted()]).train()
    assert counter.total() == 0


def test_a_key_the_log_has_is_refused_with_the_observers_name(tmp_path):
    class Shadowing(StepObserver):
        def logs(self, state):
            return {"learning_rate": 0.0}

    args = hf_args(tmp_path, per_device_train_batch_size=4, max_steps=2, logging_steps=1, save_strategy="no")
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(16), observers=[Shadowing()])
    with pytest.raises(ValueError, match=r"Shadowing.logs\(\) returned \['learning_rate'\]"):
        loop.train()


def test_an_object_without_the_two_methods_is_refused_at_construction(tmp_path):
    with pytest.raises(LoopConfigError, match="observers=.*subclass loopkit.observers.StepObserver"):
        Loop(model=tiny_regression(), args=hf_args(tmp_path), train_dataset=regression_data(8),
             observers=[lambda result: None])


# ---------------------------------------------------------------------------------------------------------------
# docs/stages.md's step-observer examples (its 4th and 5th ```python blocks)
# ---------------------------------------------------------------------------------------------------------------
def test_the_docs_max_grad_norm_is_the_largest_norm_of_the_steps_since_each_log(tmp_path):
    """Two runs from the same seed: one logs every step (each step's grad_norm), the other every 3 steps with the
    docs' `MaxGradNorm`, whose `grad_norm_max` must be the largest of those 3 norms."""
    from test_docs import python_blocks

    namespace = {}
    exec(python_blocks("docs/stages.md")[3], namespace)

    def run(folder, logging_steps, observers):
        args = hf_args(tmp_path / folder, per_device_train_batch_size=4, max_steps=6, logging_steps=logging_steps,
                       save_strategy="no", learning_rate=0.1)
        loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32), observers=observers)
        loop.train()
        return [h for h in loop.state.log_history if "loss" in h]

    each_step = [h["grad_norm"] for h in run("each", 1, [])]
    observed = run("observed", 3, [namespace["MaxGradNorm"]()])
    assert [h["step"] for h in observed] == [3, 6]
    assert len(set(each_step)) == 6  # the norms differ, so the maximum is a real choice
    for log in observed:
        assert log["grad_norm_max"] == round(max(each_step[log["step"] - 3:log["step"]]), 4)


def test_the_docs_observer_example_runs_after_the_readme_example(readme_inputs, capsys):
    from test_docs import python_blocks

    (first_example,) = python_blocks("README.md")
    namespace = dict(readme_inputs)
    exec(first_example, namespace)
    capsys.readouterr()
    exec(python_blocks("docs/stages.md")[3], namespace)
    exec(python_blocks("docs/stages.md")[4], namespace)
    logs = [h for h in namespace["loop"].state.log_history if "padding_share" in h]
    assert [h["step"] for h in logs] == [2, 4, 6, 8]  # 32 reviews in batches of 4: 8 steps, a log every 2
    assert all(h["real_tokens_per_second"] > 0 and 0 < h["padding_share"] < 1 and h["grad_norm_max"] > 0
               for h in logs)
    assert "'padding_share':" in capsys.readouterr().out


class WindowsSinceLog(StepObserver):
    """Counts the windows since the last training log (what a rate's numerator and denominator accumulate)."""

    def __init__(self):
        self.windows = 0

    def start(self, state):
        self.windows = 0

    def on_step(self, result, window, state):
        self.windows += 1

    def logs(self, state):
        windows, self.windows = self.windows, 0
        return {"windows_since_log": windows}


def test_a_second_train_logs_only_its_own_windows(tmp_path):
    """The first train() ends one window after its last log; the second train()'s first log must not count it (it
    did on 9208d82: 3 windows at step 2)."""
    counting, throughput = WindowsSinceLog(), Throughput()
    args = hf_args(tmp_path, per_device_train_batch_size=4, max_steps=3, logging_steps=2, save_strategy="no")
    loop = Loop(model=tiny_regression(), args=args, train_dataset=regression_data(32),
                observers=[counting, throughput])
    loop.train()
    assert counting.windows == 1 and throughput.seconds > 0  # step 3 was after the last log
    loop.train()
    assert [h["windows_since_log"] for h in loop.state.log_history if "loss" in h] == [2]


def test_throughput_start_forgets_what_was_accumulated():
    throughput = Throughput()
    throughput.tokens, throughput.padding, throughput.seconds = 10, torch.tensor(4), 0.5
    throughput.start(None)
    assert throughput.logs(None) == {"real_tokens_per_second": 0.0, "padding_share": 0.0}
