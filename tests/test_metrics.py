"""Streaming metrics (`Loop(metrics=[...])`) and HF's `compute_metrics` path.

Streaming values are checked against a straightforward computation over the whole eval set at once and against HF
Trainer's `compute_metrics` path run live on the same model and data; the `compute_metrics` path itself (with
`preprocess_logits_for_metrics`, `eval_accumulation_steps`, `batch_eval_metrics`, `include_for_metrics`,
`eval_do_concat_batches`, dicts of eval datasets and `predict`) must hand `compute_metrics` exactly what HF hands it.
The N-process path (samples Accelerate repeats to even out the last batch, and the reduction of running sums) is
checked by simulating N processes with Accelerate's own batch sharding.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from helpers import hf_args, lm_data, tiny_llama

from loopkit import Loop
from loopkit.metrics import (Accuracy, BatchOutputs, Metric, Perplexity, PrecisionRecallF1, TokenAccuracy,
                             real_rows, reset_all, update_all)

VOCAB, NUM_CLASSES = 64, 3
TIMING_KEYS = ("_runtime", "_samples_per_second", "_steps_per_second", "_model_preparation_time")


# ---------------------------------------------------------------------------------------------------------------
# Tiny models and data
# ---------------------------------------------------------------------------------------------------------------
class TinyClassifier(nn.Module):
    """Mean of token embeddings -> class logits, with a cross-entropy loss: a plain nn.Module."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, NUM_CLASSES)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids).mean(1))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


def classification_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (6,), generator=g),
             "labels": torch.randint(0, NUM_CLASSES, (), generator=g)} for _ in range(n)]


def ragged_lm_data(n, seed=0):
    """Causal-LM samples of different lengths (4 to 9 tokens), some label tails at -100."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = int(torch.randint(4, 10, (1,), generator=g))
        ids = torch.randint(0, VOCAB, (length,), generator=g)
        labels = ids.clone()
        labels[length - int(torch.randint(0, 3, (1,), generator=g)):] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def pad_collator(samples):
    """Pads each batch to its longest sample (inputs with 0, labels with -100), so batches differ in length."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = s["input_ids"], s["labels"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def stacked(samples):
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def untimed(metrics):
    return {k: v for k, v in metrics.items() if not k.endswith(TIMING_KEYS)}


# ---------------------------------------------------------------------------------------------------------------
# Straightforward references over the whole eval set
# ---------------------------------------------------------------------------------------------------------------
def reference_lm_metrics(model, samples):
    """Token accuracy and perplexity from one forward over all samples, shifted for a causal LM."""
    batch = stacked(samples)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1].double()
    labels = batch["labels"][:, 1:]
    counted = labels != -100
    correct = (logits.argmax(-1) == labels) & counted
    token_nll = -torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return {"token_accuracy": correct.sum().item() / counted.sum().item(),
            "perplexity": math.exp((token_nll * counted).sum().item() / counted.sum().item())}


def reference_sample_weighted_loss(model, samples, batch_size):
    """HF's `eval_loss`: the mean of per-batch mean losses, each weighted by its number of samples."""
    total = 0.0
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        with torch.no_grad():
            total += model(**stacked(chunk))["loss"].item() * len(chunk)
    return total / len(samples)


def classification_scores(predictions, labels):
    """Accuracy, macro and per-class precision / recall / F1 in numpy (macro over the classes that occur)."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    result = {"accuracy": float((predictions == labels).mean())}
    per_class, present = {}, []
    for c in range(NUM_CLASSES):
        tp = np.sum((predictions == c) & (labels == c))
        predicted, actual = np.sum(predictions == c), np.sum(labels == c)
        per_class[c] = (tp / predicted if predicted else 0.0, tp / actual if actual else 0.0,
                        2 * tp / (predicted + actual) if predicted + actual else 0.0)
        if predicted + actual:
            present.append(c)
    for i, name in enumerate(("precision", "recall", "f1")):
        result[name] = float(np.mean([per_class[c][i] for c in present]))
        result.update({f"{name}_{c}": float(per_class[c][i]) for c in range(NUM_CLASSES)})
    return result


def hf_lm_metrics(eval_prediction):
    """The usual `compute_metrics` of a causal LM, in numpy over the full logits array (N x seq x vocab)."""
    logits, labels = eval_prediction
    logits, labels = logits[:, :-1].astype(np.float64), labels[:, 1:]
    counted = labels != -100
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    token_nll = -np.take_along_axis(log_probs, np.where(counted, labels, 0)[..., None], -1)[..., 0]
    return {"token_accuracy": float(np.sum((logits.argmax(-1) == labels) & counted) / np.sum(counted)),
            "perplexity": float(np.exp(np.sum(token_nll * counted) / np.sum(counted)))}


def hf_compute_metrics(eval_prediction):
    """A typical migrated `compute_metrics`: argmax of the full logits array."""
    logits, labels = eval_prediction
    return classification_scores(np.argmax(logits, -1), labels)


def assert_metrics_close(actual: dict, expected: dict, rtol=1e-6, what=""):
    assert set(actual) == set(expected), f"{what}: keys {sorted(actual)} vs {sorted(expected)}"
    for key, value in expected.items():
        assert actual[key] == pytest.approx(value, rel=rtol, abs=1e-12), f"{what} {key}: {actual[key]} vs {value}"


# ---------------------------------------------------------------------------------------------------------------
# Streaming metric values
# ---------------------------------------------------------------------------------------------------------------
class MeanMaxLogit(Metric):
    """A user-written metric in a few lines: the mean over samples of the largest logit."""

    name = "mean_max_logit"

    def __init__(self):
        super().__init__()
        self.add_state("total", torch.zeros((), dtype=torch.float64))
        self.add_state("count", torch.zeros((), dtype=torch.int64))

    def update(self, outputs, batch):
        self.total += outputs.logits.amax(-1).sum()
        self.count += outputs.logits.shape[0]

    def compute(self):
        return self.total / self.count


def test_lm_streaming_metrics_equal_full_computation_and_loss_keeps_hf_definition(tmp_path):
    """7 samples in batches of 2: the short last batch must weigh 1 in eval_loss and its tokens once in the
    metrics; the labels' -100 tails are ignored; token metrics pair logits t with label t+1. Checked against a
    one-forward computation and against HF Trainer with the equivalent `compute_metrics`."""
    samples = lm_data(7, seq_len=8, vocab_size=VOCAB, seed=3)
    args = hf_args(tmp_path, per_device_eval_batch_size=2, use_cpu=True)
    loop = Loop(tiny_llama(), args, eval_dataset=samples, metrics=[TokenAccuracy(), Perplexity()])
    metrics = loop.evaluate()

    expected = reference_lm_metrics(tiny_llama(), samples)
    assert metrics["eval_token_accuracy"] == pytest.approx(expected["token_accuracy"], rel=1e-9)
    assert metrics["eval_perplexity"] == pytest.approx(expected["perplexity"], rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(reference_sample_weighted_loss(tiny_llama(), samples, 2), rel=1e-6)

    from transformers import Trainer

    hf_metrics = Trainer(tiny_llama(), args, eval_dataset=samples, compute_metrics=hf_lm_metrics).evaluate()
    assert list(untimed(metrics)) == list(untimed(hf_metrics)) == \
        ["eval_loss", "eval_token_accuracy", "eval_perplexity", "epoch"]
    assert_metrics_close(untimed(metrics), untimed(hf_metrics), rtol=1e-5, what="streaming vs HF compute_metrics")


def test_classification_streaming_equals_hf_compute_metrics_live(tmp_path):
    """Accuracy and precision/recall/F1 (macro and per class) streamed batch by batch equal HF Trainer's
    `compute_metrics` over the gathered logits, and loopkit's own `compute_metrics` path gives HF's dict."""
    from transformers import Trainer

    samples = classification_data(11, seed=1)
    args = hf_args(tmp_path, per_device_eval_batch_size=4, use_cpu=True)
    hf = untimed(Trainer(TinyClassifier(), args, eval_dataset=samples, compute_metrics=hf_compute_metrics).evaluate())
    loopkit_hf_path = untimed(Loop(TinyClassifier(), args, eval_dataset=samples,
                                   compute_metrics=hf_compute_metrics).evaluate())
    streaming = untimed(Loop(TinyClassifier(), args, eval_dataset=samples,
                             metrics=[Accuracy(), PrecisionRecallF1(NUM_CLASSES), MeanMaxLogit()]).evaluate())

    assert list(loopkit_hf_path) == list(hf), "compute_metrics keys (and their order) must be HF's"
    assert_metrics_close(loopkit_hf_path, hf, what="loopkit compute_metrics vs HF")
    with torch.no_grad():
        logits = TinyClassifier()(stacked(samples)["input_ids"])["logits"]
    expected_max_logit = logits.amax(-1).double().mean().item()
    assert streaming.pop("eval_mean_max_logit") == pytest.approx(expected_max_logit, rel=1e-6)
    assert_metrics_close(streaming, hf, what="streaming vs HF")


def test_precision_recall_f1_macro_skips_absent_classes_and_ignores_minus_100():
    """Token-level labels with -100 and a class that never occurs: compared with the numpy reference."""
    metric = PrecisionRecallF1(num_classes=4, class_names=["a", "b", "c", "d"])
    metric.reset("cpu")
    labels = torch.tensor([[0, 1, -100], [1, 1, 2]])
    logits = nn.functional.one_hot(torch.tensor([[0, 2, 3], [1, 0, 2]]), 4).float()
    metric.update(BatchOutputs(None, logits), {"labels": labels})
    result = {k: float(v) for k, v in metric.compute().items()}
    counted = labels != -100
    predictions, flat_labels = logits.argmax(-1)[counted].numpy(), labels[counted].numpy()
    # Class 3 ("d") is predicted only at the ignored position: it must not count.
    assert 3 not in predictions and 3 not in flat_labels
    present = sorted(set(predictions) | set(flat_labels))
    f1 = [2 * np.sum((predictions == c) & (flat_labels == c)) / (np.sum(predictions == c) + np.sum(flat_labels == c))
          for c in present]
    assert result["f1"] == pytest.approx(np.mean(f1))
    assert result["f1_d"] == 0.0 and result["precision_d"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Memory: without compute_metrics nothing but the per-sample losses is gathered or kept
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", [Accuracy(), TokenAccuracy(), Perplexity(), PrecisionRecallF1(7), MeanMaxLogit()],
                         ids=lambda m: type(m).__name__)
def test_updates_never_read_tensor_values(metric):
    """On the "meta" device tensors have shapes but no values, so any update step that would need a host sync
    (`.item()`, boolean-mask indexing, `bincount`, Python branching on a tensor) raises. All built-ins pass."""
    metric.reset("meta")
    logits = torch.empty(2, 5, 7, device="meta")
    labels = torch.empty(2, 5, dtype=torch.long, device="meta")
    metric.update(BatchOutputs(torch.empty((), device="meta"), logits), {"labels": labels})
    with pytest.raises((RuntimeError, NotImplementedError)):
        logits[labels > 0]  # the check itself works: a data-dependent op fails on meta tensors


def test_streaming_evaluation_keeps_no_logits(tmp_path, monkeypatch):
    from loopkit.stages import evaluation

    kept = []
    monkeypatch.setattr(evaluation.PredictionStore, "add", lambda self, value: kept.append(value))
    samples = lm_data(5, seq_len=8, vocab_size=VOCAB)
    loop = Loop(tiny_llama(), hf_args(tmp_path, per_device_eval_batch_size=2, use_cpu=True), eval_dataset=samples,
                metrics=[TokenAccuracy(), Perplexity()])
    gathered_shapes = []
    gather = loop.gather_function
    loop.gather_function = lambda tensor: gathered_shapes.append(tuple(tensor.shape)) or gather(tensor)
    metrics = loop.evaluate()
    assert "eval_perplexity" in metrics
    assert kept == [], "evaluate() without compute_metrics must not store predictions"
    assert gathered_shapes == [(2,), (2,), (2,)], "only the per-sample losses may be gathered"


# ---------------------------------------------------------------------------------------------------------------
# HF's compute_metrics path: what compute_metrics receives, live against HF Trainer
# ---------------------------------------------------------------------------------------------------------------
class Capture:
    """A `compute_metrics` that records what it receives (as numpy) and returns one number."""

    def __init__(self):
        self.calls = []

    def __call__(self, eval_prediction, compute_result=None):
        def to_numpy(x):
            if isinstance(x, torch.Tensor):
                return x.detach().cpu().numpy()
            if isinstance(x, dict):
                return {k: to_numpy(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(to_numpy(v) for v in x)
            return x

        self.calls.append({"predictions": to_numpy(eval_prediction.predictions),
                           "label_ids": to_numpy(eval_prediction.label_ids),
                           "inputs": to_numpy(eval_prediction.inputs), "losses": to_numpy(eval_prediction.losses),
                           "unpacked": len(tuple(eval_prediction)), "compute_result": compute_result})
        predictions = eval_prediction.predictions
        return {"checksum": float(np.asarray(to_numpy(predictions[0] if isinstance(predictions, list)
                                                      else predictions), dtype=np.float64).sum())}


def assert_same_structure(actual, expected, where):
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), where
        for k in expected:
            assert_same_structure(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), f"{where}: {type(actual)} vs " \
                                                                                f"{type(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_structure(a, e, f"{where}[{i}]")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{where}: {type(actual)}"
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, \
            f"{where}: {actual.shape} {actual.dtype} vs {expected.shape} {expected.dtype}"
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6, err_msg=where)
    else:
        assert actual == expected, f"{where}: {actual!r} vs {expected!r}"


def argmax_logits(logits, labels):
    return logits.argmax(-1)


HF_PATH_CASES = {
    "accumulate_and_concat": dict(eval_accumulation_steps=2),
    "preprocess_inputs_losses": dict(include_for_metrics=["inputs", "loss"], preprocess=True),
    "batch_eval_metrics": dict(batch_eval_metrics=True, include_for_metrics=["loss"]),
    "no_concat": dict(eval_do_concat_batches=False, eval_accumulation_steps=2),
}


@pytest.mark.parametrize("case", list(HF_PATH_CASES))
def test_compute_metrics_receives_what_hf_gives(tmp_path, case):
    """Batches padded to different lengths (so concatenation pads with -100), 7 samples in batches of 2."""
    from transformers import Trainer

    options = dict(HF_PATH_CASES[case])
    preprocess = argmax_logits if options.pop("preprocess", False) else None
    samples = ragged_lm_data(7, seed=5)
    results = {}
    for name, runner in (("hf", Trainer), ("loopkit", Loop)):
        capture = Capture()
        args = hf_args(tmp_path / name, per_device_eval_batch_size=2, use_cpu=True, **options)
        trainer = runner(tiny_llama(), args, data_collator=pad_collator, eval_dataset=samples,
                         compute_metrics=capture, preprocess_logits_for_metrics=preprocess)
        results[name] = (untimed(trainer.evaluate()), capture.calls)
    (hf_metrics, hf_calls), (lk_metrics, lk_calls) = results["hf"], results["loopkit"]
    assert len(lk_calls) == len(hf_calls) >= 1
    assert_same_structure(lk_calls, hf_calls, "compute_metrics calls")
    assert list(lk_metrics) == list(hf_metrics)
    assert_metrics_close(lk_metrics, hf_metrics, rtol=1e-5, what=case)


def test_eval_dataset_dict_and_predict_match_hf(tmp_path):
    """`eval_<name>_` keys with one `epoch`, streaming metrics under the same prefixes, and `predict` returning
    HF's `PredictionOutput` (predictions, label ids, `test_` metrics)."""
    from transformers import Trainer

    datasets = {"short": lm_data(3, seq_len=8, seed=1), "long": lm_data(5, seq_len=8, seed=2)}
    test_set = lm_data(5, seq_len=8, seed=4)
    outputs = {}
    for name, runner in (("hf", Trainer), ("loopkit", Loop)):
        args = hf_args(tmp_path / name, per_device_eval_batch_size=2, use_cpu=True)
        trainer = runner(tiny_llama(), args, eval_dataset=datasets)
        outputs[name] = (untimed(trainer.evaluate()), trainer.predict(test_set))
    (hf_eval, hf_pred), (lk_eval, lk_pred) = outputs["hf"], outputs["loopkit"]
    assert list(lk_eval) == list(hf_eval) == ["eval_short_loss", "epoch", "eval_long_loss"]
    assert_metrics_close(lk_eval, hf_eval, what="eval dict")
    assert type(lk_pred).__name__ == "PredictionOutput" and lk_pred._fields == hf_pred._fields
    np.testing.assert_allclose(lk_pred.predictions, hf_pred.predictions, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(lk_pred.label_ids, hf_pred.label_ids)
    assert list(lk_pred.metrics) == list(hf_pred.metrics)
    assert lk_pred.metrics["test_loss"] == pytest.approx(hf_pred.metrics["test_loss"], rel=1e-6)

    streaming = Loop(tiny_llama(), hf_args(tmp_path / "s", per_device_eval_batch_size=2, use_cpu=True),
                     eval_dataset=datasets, metrics=[Perplexity()]).evaluate()
    assert [k for k in streaming if "perplexity" in k] == ["eval_short_perplexity", "eval_long_perplexity"]
    for name, samples in datasets.items():
        assert streaming[f"eval_{name}_perplexity"] == pytest.approx(
            reference_lm_metrics(tiny_llama(), samples)["perplexity"], rel=1e-5)


def test_predict_without_labels_reports_no_metrics_like_hf(tmp_path):
    """Like HF's compute_metrics, streaming metrics need labels: on unlabeled data `predict` returns predictions and
    HF's keys only, instead of failing or reporting 0/0."""
    from transformers import Trainer

    unlabeled = [{"input_ids": s["input_ids"]} for s in lm_data(3, seq_len=8)]
    outputs = {}
    for name, runner, extra in (("hf", Trainer, {}), ("loopkit", Loop, {"metrics": [TokenAccuracy()]})):
        args = hf_args(tmp_path / name, per_device_eval_batch_size=2, use_cpu=True)
        outputs[name] = runner(tiny_llama(), args, **extra).predict(unlabeled)
    assert list(outputs["loopkit"].metrics) == list(outputs["hf"].metrics)
    assert outputs["loopkit"].label_ids is None
    np.testing.assert_allclose(outputs["loopkit"].predictions, outputs["hf"].predictions, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Construction-time validation and key clashes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("metrics, message", [
    ([object()], "has no update or compute method"),
    ([Accuracy], "is a class"),
    (Accuracy(), "expected a list of metrics"),
    (hf_compute_metrics, "goes to compute_metrics"),
])
def test_metrics_are_validated_at_construction(tmp_path, metrics, message):
    with pytest.raises(TypeError, match=message):
        Loop(TinyClassifier(), hf_args(tmp_path, use_cpu=True), metrics=metrics)


def test_streaming_and_compute_metrics_key_clash_is_an_error(tmp_path):
    loop = Loop(TinyClassifier(), hf_args(tmp_path, use_cpu=True), eval_dataset=classification_data(4),
                compute_metrics=hf_compute_metrics, metrics=[Accuracy()])
    with pytest.raises(ValueError, match="eval_accuracy"):
        loop.evaluate()


# ---------------------------------------------------------------------------------------------------------------
# N processes, simulated with Accelerate's own sharding of the eval batches
# ---------------------------------------------------------------------------------------------------------------
class SimulatedProcess:
    """What `real_rows` reads from an Accelerator: the process index and the gradient state at the current batch."""

    def __init__(self, index):
        self.process_index = index
        self.gradient_state = SimpleNamespace(end_of_dataloader=False, remainder=-1)


class SimulatedGather:
    """`accelerator.gather` for `Metric.sync` on one of N simulated processes: each call (one per state, in
    declaration order) returns that state from every process, stacked in process order."""

    def __init__(self, states_by_process):
        self.states_by_process = states_by_process
        self.names = iter(states_by_process[0])

    def gather(self, tensor):
        name = next(self.names)
        return torch.cat([states[name].unsqueeze(0) for states in self.states_by_process])


@pytest.mark.parametrize("num_processes, num_samples, batch_size", [(2, 7, 2), (3, 7, 2), (2, 8, 2), (3, 2, 2)])
def test_n_process_metrics_count_every_sample_once(num_processes, num_samples, batch_size):
    """Shard 7 classification samples over N processes exactly as Accelerate does (the last batch of each process is
    topped up with samples from the start), cut with `real_rows`, reduce with `Metric.sync`: the result equals the
    single-process computation over the whole set."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    samples = classification_data(num_samples, seed=7)
    model = TinyClassifier()
    remainder = num_samples % (batch_size * num_processes)
    metrics, seen = [], []
    for index in range(num_processes):
        process = SimulatedProcess(index)
        metric = PrecisionRecallF1(NUM_CLASSES)
        reset_all([metric], "cpu")
        shard = list(BatchSamplerShard(BatchSampler(SequentialSampler(range(num_samples)), batch_size, False),
                                       num_processes=num_processes, process_index=index, even_batches=True))
        for position, indices in enumerate(shard):
            process.gradient_state.end_of_dataloader = position == len(shard) - 1
            process.gradient_state.remainder = remainder
            batch = stacked([samples[i] for i in indices])
            with torch.no_grad():
                outputs = BatchOutputs(None, model(batch["input_ids"])["logits"])
            rows = real_rows(process, len(indices))
            update_all([metric], outputs, batch, rows, len(indices))
            seen += indices[:rows]
        metrics.append(metric)
    assert sorted(seen) == list(range(num_samples)), "every sample counts exactly once"

    states_by_process = [{name: getattr(m, name).clone() for name in m.state_defaults} for m in metrics]
    results = []
    for metric in metrics:
        metric.sync(SimulatedGather(states_by_process))
        results.append({k: float(v) for k, v in metric.compute().items()})
    assert all(r == results[0] for r in results), "every process computes the same result"
    with torch.no_grad():
        predictions = model(stacked(samples)["input_ids"])["logits"].argmax(-1).numpy()
    expected = classification_scores(predictions, stacked(samples)["labels"].numpy())
    expected.pop("accuracy")
    assert_metrics_close(results[0], expected, what=f"{num_processes} processes")
