"""Stage 4, evaluation and checkpoint: the log / evaluate / save schedule, evaluation and prediction loops, the
best model, and checkpoints (through `Checkpointer`).

Contract:
* `log(logs)`: HF's `Trainer.log` (adds `epoch`, appends to `log_history` with `step`, fires `on_log`).
* `after_step()`: HF's `_maybe_log_save_evaluate`: a train log when `control.should_log`, an evaluation when
  `should_evaluate` (then the best metric), a checkpoint when `should_save` (then `on_save`).
* `evaluate`, `predict`, `evaluation_loop`, `prediction_step`: HF's signatures and metric keys. The loss is summed
  on the device as it streams (memory does not grow with the eval set); logits and labels are kept only when
  `compute_metrics` needs them (or for `predict`). Streaming metrics (`Loop(metrics=[...])`, `loopkit.metrics`) see
  every batch's logits on the device and keep only running sums.
* The best model: `update_best_metric` (HF's `_determine_best_metric`), and `best_checkpoints`, the folders that
  checkpoint rotation must keep: the best one (HF), or with `EvalStage(best_total_limit=k)` the k best by
  `metric_for_best_model`, under a limit separate from `save_total_limit` (which then counts the newest only).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping

import numpy as np
import torch

from ..checkpoint import CHECKPOINT_RE, Checkpointer, restore_rng_state, rng_state
from ..guards import EvaluationInterrupted
from ..metrics import BatchOutputs, compute_all, real_rows, reset_all, update_all
from ..state import EvalLoopOutput, EvalPrediction, PredictionOutput
from .base import Stage


def speed_metrics(split: str, start_time: float, num_samples=None, num_steps=None) -> dict:
    runtime = time.time() - start_time
    result = {f"{split}_runtime": round(runtime, 4)}
    if runtime == 0:
        return result
    if num_samples is not None:
        result[f"{split}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps is not None:
        result[f"{split}_steps_per_second"] = round(num_steps / runtime, 3)
    return result


def find_batch_size(inputs) -> int | None:
    if isinstance(inputs, (list, tuple)):
        for item in inputs:
            found = find_batch_size(item)
            if found is not None:
                return found
    elif isinstance(inputs, dict):
        for value in inputs.values():
            found = find_batch_size(value)
            if found is not None:
                return found
    elif isinstance(inputs, torch.Tensor):
        return inputs.shape[0] if inputs.ndim >= 1 else None
    return None


def nested_detach(tensors):
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(nested_detach(t) for t in tensors)
    if isinstance(tensors, dict):
        return {k: nested_detach(v) for k, v in tensors.items()}
    return tensors.detach() if isinstance(tensors, torch.Tensor) else tensors


def concat_padded(chunks: list, padding_index: int = -100):
    """Concatenate per-batch arrays along dim 0, padding dim 1 to the longest (HF's `nested_concat`)."""
    first = chunks[0]
    if isinstance(first, (list, tuple)):
        return type(first)(concat_padded([c[i] for c in chunks], padding_index) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: concat_padded([c[k] for c in chunks], padding_index) for k in first}
    arrays = [np.asarray(c) for c in chunks]
    if arrays[0].ndim < 2 or all(a.shape[1] == arrays[0].shape[1] for a in arrays):
        return np.concatenate(arrays, axis=0)
    width = max(a.shape[1] for a in arrays)
    out = np.full((sum(a.shape[0] for a in arrays), width) + arrays[0].shape[2:], padding_index,
                  dtype=arrays[0].dtype)
    row = 0
    for a in arrays:
        out[row:row + a.shape[0], :a.shape[1]] = a
        row += a.shape[0]
    return out


def to_numpy(tensors):
    """Nested tensors -> numpy arrays on the host (bfloat16 as float32: numpy has none); HF's `nested_numpify`."""
    if isinstance(tensors, (list, tuple)):
        return type(tensors)(to_numpy(t) for t in tensors)
    if isinstance(tensors, dict):
        return {k: to_numpy(v) for k, v in tensors.items()}
    if isinstance(tensors, torch.Tensor):
        t = tensors.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return tensors


def plain_metrics(metrics):
    """numpy scalars and one-element tensors -> Python numbers, through lists and dicts (HF's
    `denumpify_detensorize`)."""
    if isinstance(metrics, (list, tuple)):
        return type(metrics)(plain_metrics(m) for m in metrics)
    if isinstance(metrics, dict):
        return type(metrics)({k: plain_metrics(v) for k, v in metrics.items()})
    if isinstance(metrics, np.generic):
        return metrics.item()
    if isinstance(metrics, torch.Tensor) and metrics.numel() == 1:
        return metrics.item()
    return metrics


def carries_labels(inputs, label_names) -> bool:
    """HF's `has_labels`: every label column is in the batch and not None."""
    return bool(label_names) and all(inputs.get(k) is not None for k in label_names)


def with_prefix(key: str, prefix: str) -> str:
    """`eval_accuracy` from `accuracy`; a key that already starts with the prefix stays as it is (HF)."""
    return key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"


class PredictionStore:
    """Per-batch predictions, labels, inputs or losses kept for `compute_metrics` or `predict`; moved to the host
    every `eval_accumulation_steps` batches. The result is one array padded with -100 along dim 1 (HF's
    `EvalLoopContainer`), or the list of per-batch arrays when `eval_do_concat_batches=False`."""

    def __init__(self, concat: bool = True):
        self.concat = concat
        self.device_chunks, self.host_chunks = [], []

    def add(self, value):
        if value is not None:
            self.device_chunks.append(value)

    def offload(self):
        self.host_chunks += [to_numpy(c) for c in self.device_chunks]
        self.device_chunks = []

    def result(self):
        self.offload()
        if not self.host_chunks:
            return None
        return concat_padded(self.host_chunks) if self.concat else self.host_chunks


class EvalStage(Stage):
    """The log / evaluate / save schedule, the evaluation loops, the best model and checkpoints.

    `best_total_limit=k` keeps the k best checkpoints (by `metric_for_best_model`) under their own limit: rotation
    then keeps the `save_total_limit` newest checkpoints plus the k best, and the end of training deletes nothing
    more. Without it, HF's rule applies: `save_total_limit` counts every checkpoint, the newest and the best are
    protected, and with a limit of 1 only the best survives the end of training.
    """

    def __init__(self, best_total_limit: int | None = None, async_save: bool = False, on_save_error: str = "raise"):
        if best_total_limit is not None and (not isinstance(best_total_limit, int) or best_total_limit < 1):
            from ..args import config_error

            raise config_error("best_total_limit", best_total_limit, "it is the number of best checkpoints to keep",
                               "pass a positive integer, or None for HF's single protected best")
        self.best_total_limit = best_total_limit
        self.checkpoint_options = dict(async_save=async_save, on_save_error=on_save_error)
        self.checkpointer = None
        self.pending_evaluation = None  # an evaluation a preemption interrupted (resumed runs do it first)
        self.last_logged_step = 0
        self.total_loss_scalar = 0.0
        self.model_preparation_time = None

    def bind(self, loop) -> "EvalStage":
        super().bind(loop)
        self.checkpointer = Checkpointer(loop, **self.checkpoint_options)
        return self

    # -- logging --
    def log(self, logs: dict, start_time=None) -> None:
        loop = self.loop
        logs["epoch"] = loop.state.epoch
        loop.state.log_history.append({**logs, "step": loop.state.global_step})
        loop.fire("on_log", logs=logs)

    def log_training_progress(self) -> None:
        """The step log: mean loss per optimizer step since the last log, pre-clip grad norm, LR. The one host sync
        of the training loop happens here, at logging points only."""
        loop, step = self.loop, self.loop.step
        loss_sum = loop.accelerator.gather(step.tr_loss.detach()).mean().item()
        step.tr_loss.zero_()
        logs = {"loss": loss_sum / (loop.state.global_step - self.last_logged_step)}
        if step.grad_norm is not None:
            logs["grad_norm"] = step.grad_norm.item() if isinstance(step.grad_norm, torch.Tensor) else step.grad_norm
        logs["learning_rate"] = step.learning_rate
        self.total_loss_scalar += loss_sum
        self.last_logged_step = loop.state.global_step
        loop.store_flos()
        self.log(logs)

    # -- the schedule after each optimizer step and each epoch --
    def after_step(self, ignore_keys_for_eval=None) -> None:
        loop = self.loop
        if loop.control.should_log and loop.state.global_step > self.last_logged_step:
            self.log_training_progress()
        if loop.control.should_evaluate:
            rng_before = rng_state() if loop.preemption.active else None
            try:
                with loop.clock.span("evaluation"):
                    metrics = self.evaluate_during_training(ignore_keys_for_eval)
            except EvaluationInterrupted:
                # Preempted mid-evaluation: the checkpoint the loop now writes remembers the evaluation (and the
                # save that would have followed) and the RNG from before it; a resumed run does them first.
                self.pending_evaluation = {"should_save": bool(loop.control.should_save)}
                loop.checkpointer.rng_for_next_save = rng_before
                return
            is_new_best = self.update_best_metric(metrics)
            if loop.args.save_strategy == "best":
                loop.control.should_save = is_new_best
        if loop.control.should_save:
            self.save_checkpoint()
            loop.fire("on_save")

    def run_pending_evaluation(self, resume, ignore_keys_for_eval=None) -> None:
        """After a resume: the evaluation a preemption interrupted, and the save scheduled after it. It starts from
        the RNG state saved before it, and training then continues from the state it leaves."""
        pending, self.pending_evaluation = self.pending_evaluation, None
        if pending is None or resume is None:
            return
        if resume.rng is not None:
            restore_rng_state(resume.rng)
        self.loop.control.should_evaluate = True
        self.loop.control.should_save = pending["should_save"]
        self.after_step(ignore_keys_for_eval)
        resume.rng = rng_state()

    def evaluate_during_training(self, ignore_keys=None, skip_scheduler=False) -> dict:
        loop = self.loop
        metrics = loop.evaluate(ignore_keys=ignore_keys)
        scheduler = loop.lr_scheduler
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not skip_scheduler:
            name = self.best_metric_key()
            scheduler.step(metrics[name])
        return metrics

    def best_metric_key(self) -> str:
        name = self.loop.args.metric_for_best_model
        return name if name.startswith("eval_") else f"eval_{name}"

    def update_best_metric(self, metrics: dict) -> bool:
        args, state = self.loop.args, self.loop.state
        if args.metric_for_best_model is None:
            return False
        key = self.best_metric_key()
        if key not in metrics:
            raise KeyError(f"metric_for_best_model={args.metric_for_best_model!r} looks for {key!r}, which the "
                           f"evaluation did not produce (it has {sorted(metrics)}). Fix: name one of those.")
        value = metrics[key]
        if state.best_metric is None:
            state.best_metric = -math.inf if args.greater_is_better else math.inf
        better = value > state.best_metric if args.greater_is_better else value < state.best_metric
        if better:
            state.best_metric = value
            if args.save_strategy in ("steps", "epoch", "best"):
                state.best_global_step = state.global_step
        return better

    def checkpoint_scores(self, dirs: list[str]) -> dict[str, float]:
        """`metric_for_best_model` of each checkpoint folder in `dirs` whose step was evaluated (from `log_history`,
        which resumes with the run); non-finite values are left out."""
        if self.loop.args.metric_for_best_model is None:
            return {}
        key = self.best_metric_key()
        by_step = {entry["step"]: entry[key] for entry in self.loop.state.log_history if key in entry}
        scores = {}
        for path in dirs:
            step = int(CHECKPOINT_RE.match(os.path.basename(path)).group(1))
            if step in by_step and math.isfinite(by_step[step]):
                scores[path] = by_step[step]
        return scores

    def best_checkpoints(self, dirs: list[str]) -> set[str]:
        """The folders among `dirs` that rotation must keep as best: `state.best_model_checkpoint` (HF), plus, with
        `best_total_limit=k`, the k best scored checkpoints (ties: the earlier step, as a strict improvement
        decides the best)."""
        recorded = self.loop.state.best_model_checkpoint
        # Compared as real paths: `output_dir` may be relative, and a resumed run's best may lie in another folder.
        best = {d for d in dirs if recorded is not None and os.path.realpath(d) == os.path.realpath(recorded)}
        if self.best_total_limit is not None:
            scores = self.checkpoint_scores(dirs)
            sign = -1 if self.loop.args.greater_is_better else 1
            ranked = sorted(scores, key=lambda path: (sign * scores[path], dirs.index(path)))
            best.update(ranked[:self.best_total_limit])
        return best

    def save_checkpoint(self) -> None:
        self.loop.store_flos()
        with self.loop.clock.span("checkpoint"):
            self.checkpointer.save()

    # -- evaluate / predict --
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        loop = self.loop
        override = eval_dataset is not None
        datasets = eval_dataset if override else loop.eval_dataset
        if isinstance(datasets, dict):
            metrics = {}
            for name, dataset in datasets.items():
                metrics.update(self.evaluate(dataset if override else name, ignore_keys,
                                             f"{metric_key_prefix}_{name}"))
            return metrics
        dataloader = loop.get_eval_dataloader(eval_dataset)
        # Without compute_metrics no predictions are kept (streaming metrics still see every batch's logits).
        output = self.timed_loop(dataloader, "Evaluation", True if loop.compute_metrics is None else None,
                                 ignore_keys, metric_key_prefix)
        self.log(output.metrics)
        loop.fire("on_evaluate", metrics=output.metrics)
        return output.metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        loop = self.loop
        dataloader = loop.get_test_dataloader(test_dataset)
        output = self.timed_loop(dataloader, "Prediction", None, ignore_keys, metric_key_prefix)
        loop.fire("on_predict", metrics=output.metrics)
        return PredictionOutput(output.predictions, output.label_ids, output.metrics)

    def timed_loop(self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix):
        """`evaluation_loop` plus HF's speed metrics; the model's preparation time is not part of the runtime."""
        loop = self.loop
        start = time.time()
        output = loop.evaluation_loop(dataloader, description=description, prediction_loss_only=prediction_loss_only,
                                      ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        start += output.metrics.get(f"{metric_key_prefix}_model_preparation_time", 0)
        total_batch = loop.args.per_device_eval_batch_size * loop.accelerator.num_processes
        output.metrics.update(speed_metrics(metric_key_prefix, start, num_samples=output.num_samples,
                                            num_steps=math.ceil(output.num_samples / total_batch)))
        return output

    def eval_model(self):
        """The model to evaluate; prepared for evaluation the first time if training has not prepared it."""
        loop = self.loop
        if len(loop.accelerator._models) == 0 and loop.model_wrapped is loop.model:
            start = time.time()
            loop.model_wrapped = loop.accelerator.prepare_model(loop.model, evaluation_mode=True)
            self.model_preparation_time = round(time.time() - start, 4)
        return loop.model_wrapped

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval") -> EvalLoopOutput:
        loop, args, acc = self.loop, self.loop.args, self.loop.accelerator
        if prediction_loss_only is None:
            prediction_loss_only = args.prediction_loss_only
        model = self.eval_model()
        model.eval()
        if callable(getattr(loop.optimizer, "eval", None)):
            loop.optimizer.eval()
        loop.callback_handler.eval_dataloader = dataloader
        batch_size = args.per_device_eval_batch_size
        keep_for_metrics = not args.batch_eval_metrics or description == "Prediction"
        preds, labels_store, inputs_store, losses_store = (PredictionStore(args.eval_do_concat_batches)
                                                           for _ in range(4))
        want_inputs = "inputs" in args.include_for_metrics
        want_losses = "loss" in args.include_for_metrics
        streaming = loop.metrics
        reset_all(streaming, acc.device)
        labelled_batches = 0  # streaming metrics, like compute_metrics, need labels
        # The loss streams into device sums: finite values, and all values (used only if none is finite).
        sums = torch.zeros(3, dtype=torch.float64, device=acc.device)
        total_n = 0  # gathered loss values: a shape, so counted on the host
        main_input = getattr(loop.model, "main_input_name", "input_ids")
        metrics, observed = None, 0
        interruptible = loop.preemption.active and acc.num_processes == 1  # ranks must not leave collectives
        for step, inputs in enumerate(dataloader):
            if interruptible and loop.preemption.requested:
                raise EvaluationInterrupted(f"signal {loop.preemption.signum} during evaluation")
            rows = find_batch_size(inputs) or 0
            observed += rows
            # Streaming metrics need the logits even when no prediction is kept, and the labels: a shallow copy of
            # the batch keeps them should a custom compute_loss pop them.
            batch = dict(inputs) if streaming and isinstance(inputs, Mapping) else inputs
            loss, logits, labels = loop.prediction_step(model, inputs, prediction_loss_only and not streaming,
                                                        ignore_keys=ignore_keys)
            if streaming and carries_labels(batch, loop.label_names):
                labelled_batches += 1
                update_all(streaming, BatchOutputs(loss, logits), batch, real_rows(acc, rows), rows)
                if prediction_loss_only:
                    logits = labels = None  # used by the streaming metrics only: never kept
            inputs_decode = inputs[main_input] if want_inputs else None
            losses = None
            if loss is not None:
                losses = loop.gather_function(loss.repeat(batch_size))
                finite = torch.isfinite(losses)
                sums += torch.stack([torch.where(finite, losses, 0).sum(), finite.sum(), losses.sum()]).double()
                total_n += losses.numel()
                if want_losses and keep_for_metrics:
                    losses_store.add(losses)
            if inputs_decode is not None:
                inputs_decode = loop.gather_function(acc.pad_across_processes(inputs_decode, dim=1, pad_index=-100))
                if keep_for_metrics:
                    inputs_store.add(inputs_decode)
            if labels is not None:
                labels = acc.pad_across_processes(labels, dim=1, pad_index=-100)
            if logits is not None:
                logits = acc.pad_across_processes(logits, dim=1, pad_index=-100)
                if loop.preprocess_logits_for_metrics is not None:
                    logits = loop.preprocess_logits_for_metrics(logits, labels)
                logits = loop.gather_function(logits)
                if keep_for_metrics:
                    preds.add(logits)
            if labels is not None:
                labels = loop.gather_function(labels)
                if keep_for_metrics:
                    labels_store.add(labels)
            loop.fire("on_prediction_step")
            if args.batch_eval_metrics:
                if loop.compute_metrics is not None and logits is not None and labels is not None:
                    # As HF: the gathered per-sample losses, and the whole batch as inputs.
                    batch_kwargs = {"losses": losses if want_losses else None,
                                    "inputs": inputs if want_inputs else None}
                    metrics = loop.compute_metrics(EvalPrediction(predictions=logits, label_ids=labels,
                                                                  **batch_kwargs),
                                                   compute_result=acc.gradient_state.end_of_dataloader)
            elif args.eval_accumulation_steps is not None and (step + 1) % args.eval_accumulation_steps == 0:
                for store in (preds, labels_store, inputs_store, losses_store):
                    store.offload()
        all_preds, all_labels = preds.result(), labels_store.result()
        all_inputs, all_losses = inputs_store.result(), losses_store.result()
        dataset = getattr(dataloader, "dataset", None)
        num_samples = len(dataset) if hasattr(dataset, "__len__") else observed
        if num_samples == 0 and observed > 0:
            num_samples = observed
        if loop.compute_metrics is not None and all_preds is not None and all_labels is not None \
                and not args.batch_eval_metrics:
            metrics = loop.compute_metrics(EvalPrediction(
                predictions=all_preds, label_ids=all_labels,
                inputs=all_inputs if want_inputs else None, losses=all_losses if want_losses else None))
        elif metrics is None:
            metrics = {}
        if streaming and labelled_batches > 0:
            streamed = compute_all(streaming, acc)
            clash = sorted({with_prefix(k, metric_key_prefix) for k in streamed}
                           & {with_prefix(k, metric_key_prefix) for k in metrics})
            if clash:
                raise ValueError(f"compute_metrics and the streaming metrics both produce {clash}. Fix: rename the "
                                 f"streaming metric (name=...) or drop the key from compute_metrics.")
            metrics = {**metrics, **streamed}
        metrics = plain_metrics(metrics)
        finite_sum, finite_n, total_sum = sums.tolist()
        if total_n > 0:
            use_finite = args.logging_nan_inf_filter and finite_n > 0
            metrics[f"{metric_key_prefix}_loss"] = finite_sum / finite_n if use_finite else total_sum / total_n
        if self.model_preparation_time is not None:
            metrics[f"{metric_key_prefix}_model_preparation_time"] = self.model_preparation_time
        # HF pops each unprefixed key and re-inserts it prefixed, so `eval_loss` comes before `eval_<metric>`.
        metrics = {**{k: v for k, v in metrics.items() if k == with_prefix(k, metric_key_prefix)},
                   **{with_prefix(k, metric_key_prefix): v for k, v in metrics.items()
                      if k != with_prefix(k, metric_key_prefix)}}
        return EvalLoopOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics, num_samples=num_samples)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loop = self.loop
        label_names = loop.label_names
        has_labels = carries_labels(inputs, label_names)
        if ignore_keys is None:
            config = getattr(loop.model, "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", ["cache"])) if config else []
        labels = None
        if has_labels:
            labels = nested_detach(tuple(inputs.get(name) for name in label_names))
            labels = labels[0] if len(labels) == 1 else labels
        with torch.no_grad():
            if has_labels:
                num_items = loop.count_loss_items([inputs])
                with loop.compute_loss_context_manager():
                    loss, outputs = loop.compute_loss(model, inputs, return_outputs=True,
                                                      num_items_in_batch=num_items)
                loss = loss.detach().mean()
                logits = tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"]) \
                    if isinstance(outputs, dict) else outputs[1:]
            else:
                loss = None
                with loop.compute_loss_context_manager():
                    outputs = model(**inputs)
                logits = tuple(v for k, v in outputs.items() if k not in ignore_keys) \
                    if isinstance(outputs, dict) else outputs
        if prediction_loss_only:
            return loss, None, None
        logits = nested_detach(logits)
        if len(logits) == 1:
            logits = logits[0]
        return loss, logits, labels

    # -- checkpointed state: the running-loss bookkeeping --
    def state_dict(self) -> dict:
        return {"last_logged_step": self.last_logged_step, "pending_evaluation": self.pending_evaluation}

    def load_state_dict(self, state: dict) -> None:
        self.last_logged_step = state.get("last_logged_step", self.last_logged_step)
        self.pending_evaluation = state.get("pending_evaluation")
