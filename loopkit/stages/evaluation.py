"""Stage 4, evaluation: HF's `evaluate`, `predict`, `evaluation_loop` and `prediction_step`, batch by batch.

Contract:
* `evaluate`, `predict`, `evaluation_loop`, `prediction_step`: HF's signatures and metric keys; `evaluate` logs its
  metrics (`context.log`) and fires `on_evaluate`, `predict` fires `on_predict`; each is framed by loopkit's
  `on_evaluate_begin` / `on_evaluate_end` (`on_predict_begin` / `on_predict_end`), the end one fired even on an error.
* The loss is summed on the device as it streams (`LossSum`: memory does not grow with the eval set); logits and
  labels are kept only when `compute_metrics` needs them or for `predict` (`PredictionStore`). Streaming metrics
  (`Loop(metrics=[...])`, `loopkit.metrics`) see every batch's logits on the device and keep only running sums.
* `checkpoint_options()`: how checkpoints are written (`async_save`, `on_save_error`, `best_total_limit`); the
  `Loop` hands them to the default checkpoint storage (their place is the storage: `loopkit.storage`). When to
  log, evaluate and save is the `Schedule`'s business (loopkit/schedule.py), not this stage's.

Reads `run.args`, `run.model`, `run.model_wrapped`, `run.optimizer`, `run.label_names`, `run.metrics`,
`run.compute_metrics`, `run.preprocess_logits_for_metrics`, `run.is_in_train` (`bf16_full_eval` / `fp16_full_eval`
cast the model outside training); uses `context.accelerator`, `context.compute_loss`, `context.count_loss_items`,
`context.compute_loss_context_manager`, `context.gather_function`, `context.preemption`, `context.memory`,
`context.log`, `context.events`, and gets its loaders through the context's `get_eval_dataloader` /
`get_test_dataloader`; writes `run.eval_dataloader`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

import torch

from ..batches import (carries_labels, concat_padded, find_batch_size, has_length, nested_detach, plain_metrics,
                       shallow_copy, to_numpy)
from ..errors import config_error
from ..guards import EvaluationInterrupted
from ..metrics import BatchOutputs, compute_all, real_rows, reset_all, update_all, warn_no_rows
from ..parallelism import check_streaming_metrics
from ..trainer import log_messages
from ..phases import speed_metrics
from ..state import EvalLoopOutput, EvalPrediction, PredictionOutput
from .base import Stage


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


class LossSum:
    """The evaluation loss summed on the device in float64 as it streams: the finite values and their count, and
    all values (used only when none is finite). The number of values is a shape, so it is counted on the host."""

    def __init__(self, device):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.count = 0

    def add(self, losses: torch.Tensor) -> None:
        finite = torch.isfinite(losses)
        self.sums += torch.stack([torch.where(finite, losses, 0).sum(), finite.sum(), losses.sum()]).double()
        self.count += losses.numel()

    def mean(self, nan_inf_filter: bool) -> float | None:
        if self.count == 0:
            return None
        finite_sum, finite_n, total_sum = self.sums.tolist()
        return finite_sum / finite_n if nan_inf_filter and finite_n > 0 else total_sum / self.count


class EvalAccumulators:
    """What one evaluation keeps: the loss sum, the predictions / labels / inputs / losses for `compute_metrics` or
    `predict` (when `keep`), and the sample and labelled-batch counts."""

    def __init__(self, device, concat: bool, keep: bool, description: str):
        self.description = description  # "Evaluation" or "Prediction"
        self.loss = LossSum(device)
        self.preds, self.labels, self.inputs, self.losses = (PredictionStore(concat) for _ in range(4))
        self.keep = keep
        self.observed = 0  # samples seen on this process (the sample count of a dataset without a length)
        self.labelled_batches = 0  # batches the streaming metrics saw (they need labels, like compute_metrics)
        self.last_batch = None  # for the warning when no batch carried labels

    def offload(self) -> None:
        for store in (self.preds, self.labels, self.inputs, self.losses):
            store.offload()

    def add(self, store: PredictionStore, value) -> None:
        if self.keep:
            store.add(value)


class EvalStage(Stage):
    """Evaluation and prediction, and the options of the run's checkpoints.

    `best_total_limit=k` keeps the k best checkpoints (by `metric_for_best_model`) under their own limit: rotation
    then keeps the `save_total_limit` newest checkpoints plus the k best, and the end of training deletes nothing
    more. Without it, HF's rule applies: `save_total_limit` counts every checkpoint, the newest and the best are
    protected, and with a limit of 1 only the best survives the end of training. `async_save` and `on_save_error`:
    see `loopkit.storage.CheckpointStorage`.

    The three options belong to the checkpoint storage (`Loop(..., storage=HFStorage(async_save=True))`); given
    here, they are handed to the default storage (with a storage passed too, the `Loop` asks to move them there).
    """

    def __init__(self, best_total_limit: int | None = None, async_save: bool = False, on_save_error: str = "raise"):
        from ..storage.base import check_options

        check_options(on_save_error, best_total_limit)  # the storage's rules: the options end up there
        self.options = dict(best_total_limit=best_total_limit, async_save=async_save, on_save_error=on_save_error)
        self.prepared_for_eval = None  # (model, the model prepared for evaluation) before any training
        self.model_preparation_time = None

    #: whether the stage honours `predict_with_generate=True` (a `Seq2SeqTrainingArguments` field): only a
    #: generating stage does (loopkit/stages/seq2seq.py); any other refuses it rather than ignore it.
    generates = False

    def bind(self, run, context) -> "EvalStage":
        if getattr(run.args, "predict_with_generate", False) and not self.generates:
            raise config_error("predict_with_generate", True, f"the evaluation stage {type(self).__name__} does "
                               "not generate", "replace Loop( with Seq2SeqLoop( (as Seq2SeqTrainer), or pass "
                               "evaluation=Seq2SeqEvalStage()")
        return super().bind(run, context)

    def checkpoint_options(self) -> dict:
        """The checkpoint options given to this stage, for the default storage (`loopkit.storage.HFStorage`)."""
        return dict(self.options)

    # -- evaluate / predict --
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        run, context = self.run, self.context
        override = eval_dataset is not None
        datasets = eval_dataset if override else run.eval_dataset
        if isinstance(datasets, dict):
            metrics = {}
            for name, dataset in datasets.items():
                metrics.update(self.evaluate(dataset if override else name, ignore_keys,
                                             f"{metric_key_prefix}_{name}"))
            return metrics
        context.events.fire("on_evaluate_begin")
        try:  # the end event even when evaluation raises: a listener that changed the model puts it back
            context.memory.start("eval")
            dataloader = context.get_eval_dataloader(eval_dataset)
            # Without compute_metrics no predictions are kept (streaming metrics still see every batch's logits).
            output = self.timed_loop(dataloader, "Evaluation", True if run.compute_metrics is None else None,
                                     ignore_keys, metric_key_prefix)
            context.log(output.metrics)
            context.events.fire("on_evaluate", metrics=output.metrics)
            context.memory.stop_and_update_metrics("eval", output.metrics)  # HF: in the returned metrics only
        finally:
            context.events.fire("on_evaluate_end")
        return output.metrics

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test") -> PredictionOutput:
        context = self.context
        context.events.fire("on_predict_begin")
        try:
            context.memory.start("test")
            dataloader = context.get_test_dataloader(test_dataset)
            output = self.timed_loop(dataloader, "Prediction", None, ignore_keys, metric_key_prefix)
            context.events.fire("on_predict", metrics=output.metrics)
            context.memory.stop_and_update_metrics("test", output.metrics)
        finally:
            context.events.fire("on_predict_end")
        return PredictionOutput(output.predictions, output.label_ids, output.metrics)

    def timed_loop(self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix):
        """`evaluation_loop` plus HF's speed metrics; the model's preparation time is not part of the runtime."""
        run, context = self.run, self.context
        start = time.time()
        output = self.evaluation_loop(dataloader, description=description, prediction_loss_only=prediction_loss_only,
                                      ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        start += output.metrics.get(f"{metric_key_prefix}_model_preparation_time", 0)
        total_batch = run.args.per_device_eval_batch_size * context.accelerator.num_processes
        output.metrics.update(speed_metrics(metric_key_prefix, start, num_samples=output.num_samples,
                                            num_steps=math.ceil(output.num_samples / total_batch)))
        return output

    def eval_model(self):
        """The model to evaluate: the training-prepared one, or, before any training, the model prepared for
        evaluation (once per model; the time it took is reported as HF does)."""
        run, context = self.run, self.context
        if run.model_wrapped is not None:
            return run.model_wrapped
        if self.prepared_for_eval is None or self.prepared_for_eval[0] is not run.model:
            start = time.time()
            self.prepared_for_eval = (run.model, context.accelerator.prepare_model(run.model, evaluation_mode=True))
            self.model_preparation_time = round(time.time() - start, 4)
        return self.prepared_for_eval[1]

    def cast_for_full_eval(self, model):
        """`fp16_full_eval` / `bf16_full_eval`: outside `train()`, HF casts the model itself (in place: it stays
        in that dtype afterwards, as in HF) and evaluates without autocast's float32 weights."""
        run, context, args = self.run, self.context, self.run.args
        if run.is_in_train:
            return model
        if args.fp16_full_eval:
            return model.to(dtype=torch.float16, device=context.accelerator.device)
        if args.bf16_full_eval:
            return model.to(dtype=torch.bfloat16, device=context.accelerator.device)
        return model

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval") -> EvalLoopOutput:
        run, context, args = self.run, self.context, self.run.args
        if prediction_loss_only is None:
            prediction_loss_only = args.prediction_loss_only
        log_messages.log_evaluation_start(description, dataloader, args)
        model = self.cast_for_full_eval(self.eval_model())
        model.eval()
        if callable(getattr(run.optimizer, "eval", None)):
            run.optimizer.eval()
        run.eval_dataloader = dataloader
        acc = EvalAccumulators(context.accelerator.device, args.eval_do_concat_batches,
                               keep=not args.batch_eval_metrics or description == "Prediction",
                               description=description)
        check_streaming_metrics(context.accelerator, run.metrics)  # tensor parallel: refused (parallelism.py)
        reset_all(run.metrics, context.accelerator.device)
        batch_metrics = None
        for step, inputs in enumerate(dataloader):
            self.stop_if_preempted()
            result = self.evaluate_batch(model, inputs, acc, prediction_loss_only, ignore_keys)
            batch_metrics = result if result is not None else batch_metrics
            if not args.batch_eval_metrics and args.eval_accumulation_steps is not None and \
                    (step + 1) % args.eval_accumulation_steps == 0:
                acc.offload()
        return self.finish_evaluation(acc, batch_metrics, dataloader, metric_key_prefix)

    def stop_if_preempted(self) -> None:
        """A preemption signal abandons the evaluation (one process only: ranks must not leave collectives)."""
        watch = self.context.preemption
        if watch.active and self.context.accelerator.num_processes == 1 and watch.requested:
            raise EvaluationInterrupted(f"signal {watch.signum} during evaluation")

    def evaluate_batch(self, model, inputs, acc: EvalAccumulators, prediction_loss_only, ignore_keys):
        """One batch: prediction step, streaming metrics, loss sum, gathered predictions; HF's per-batch
        `compute_metrics` result with `batch_eval_metrics`, else None."""
        run, context, args = self.run, self.context, self.run.args
        rows = find_batch_size(inputs) or 0
        acc.observed += rows
        streaming = run.metrics
        # Streaming metrics need the logits even when no prediction is kept, and the labels: a shallow copy of the
        # batch keeps them should a custom compute_loss pop them.
        batch = acc.last_batch = shallow_copy(inputs) if streaming else inputs
        loss, logits, labels = self.prediction_step(model, inputs, prediction_loss_only and not streaming,
                                                    ignore_keys=ignore_keys)
        # A tuple batch has no label names: its metrics read labels by position (`label_key=1`).
        if streaming and (carries_labels(batch, run.label_names) or not isinstance(batch, Mapping)):
            acc.labelled_batches += 1
            update_all(streaming, BatchOutputs(loss, logits), batch, real_rows(context.accelerator, rows), rows)
            if prediction_loss_only:
                logits = labels = None  # used by the streaming metrics only: never kept
        losses = self.gather_losses(loss, acc)
        logits, labels = self.gather_predictions(inputs, logits, labels, acc)
        context.events.fire("on_prediction_step")
        if args.batch_eval_metrics and run.compute_metrics is not None and logits is not None \
                and labels is not None:
            # As HF: the gathered per-sample losses, and the whole batch as inputs.
            want = args.include_for_metrics
            return run.compute_metrics(
                EvalPrediction(predictions=logits, label_ids=labels, losses=losses if "loss" in want else None,
                               inputs=inputs if "inputs" in want else None),
                compute_result=context.accelerator.gradient_state.end_of_dataloader)
        return None

    def gather_losses(self, loss, acc: EvalAccumulators):
        """The batch's loss, repeated per sample and gathered from every process (HF), into the loss sum."""
        if loss is None:
            return None
        run, context = self.run, self.context
        losses = context.gather_function(loss.repeat(run.args.per_device_eval_batch_size))
        acc.loss.add(losses)
        if "loss" in run.args.include_for_metrics:
            acc.add(acc.losses, losses)
        return losses

    def gather_predictions(self, inputs, logits, labels, acc: EvalAccumulators):
        """Inputs, logits and labels padded to one width across processes and gathered (HF's order)."""
        run, gather, accelerator = self.run, self.context.gather_function, self.context.accelerator
        if "inputs" in run.args.include_for_metrics:
            main = inputs[getattr(run.model, "main_input_name", "input_ids")]
            acc.add(acc.inputs, gather(accelerator.pad_across_processes(main, dim=1, pad_index=-100)))
        if labels is not None:
            labels = accelerator.pad_across_processes(labels, dim=1, pad_index=-100)
        if logits is not None:
            logits = accelerator.pad_across_processes(logits, dim=1, pad_index=-100)
            if run.preprocess_logits_for_metrics is not None:
                logits = run.preprocess_logits_for_metrics(logits, labels)
            logits = gather(logits)
            acc.add(acc.preds, logits)
        if labels is not None:
            labels = gather(labels)
            acc.add(acc.labels, labels)
        return logits, labels

    def finish_evaluation(self, acc: EvalAccumulators, metrics, dataloader, prefix: str) -> EvalLoopOutput:
        """Metrics from the accumulated predictions and the streaming metrics, the loss, HF's key order."""
        run, args = self.run, self.run.args
        all_preds, all_labels = acc.preds.result(), acc.labels.result()
        all_inputs, all_losses = acc.inputs.result(), acc.losses.result()
        dataset = getattr(dataloader, "dataset", None)
        num_samples = len(dataset) if has_length(dataset) else acc.observed
        if num_samples == 0 and acc.observed > 0:
            num_samples = acc.observed
        if run.compute_metrics is not None and all_preds is not None and all_labels is not None \
                and not args.batch_eval_metrics:
            want = args.include_for_metrics
            metrics = run.compute_metrics(EvalPrediction(
                predictions=all_preds, label_ids=all_labels, inputs=all_inputs if "inputs" in want else None,
                losses=all_losses if "loss" in want else None))
        metrics = dict(metrics or {})
        if run.metrics:
            metrics = {**metrics, **self.streamed_metrics(acc, metrics, prefix)}
        metrics = plain_metrics(metrics)
        loss = acc.loss.mean(args.logging_nan_inf_filter)
        if loss is not None:
            metrics[f"{prefix}_loss"] = loss
        if self.model_preparation_time is not None:
            metrics[f"{prefix}_model_preparation_time"] = self.model_preparation_time
        # HF pops each unprefixed key and re-inserts it prefixed, so `eval_loss` comes before `eval_<metric>`.
        metrics = {**{k: v for k, v in metrics.items() if k == with_prefix(k, prefix)},
                   **{with_prefix(k, prefix): v for k, v in metrics.items() if k != with_prefix(k, prefix)}}
        return EvalLoopOutput(predictions=all_preds, label_ids=all_labels, metrics=metrics, num_samples=num_samples)

    def streamed_metrics(self, acc: EvalAccumulators, metrics: dict, prefix: str) -> dict:
        """The streaming metrics' results; a warning when no batch carried labels (an unlabelled test set is
        normal for `predict`), and a clear error where their keys clash with `compute_metrics`'."""
        run, context = self.run, self.context
        if acc.labelled_batches == 0:
            if acc.description == "Evaluation":
                warn_no_rows(run.metrics, run.label_names, acc.last_batch)
            return {}
        streamed = compute_all(run.metrics, context.accelerator)
        clash = sorted({with_prefix(k, prefix) for k in streamed} & {with_prefix(k, prefix) for k in metrics})
        if clash:
            raise ValueError(f"compute_metrics and the streaming metrics both produce {clash}. Fix: rename the "
                             f"streaming metric (name=...) or drop the key from compute_metrics.")
        return streamed

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        run, context = self.run, self.context
        has_labels = carries_labels(inputs, run.label_names)
        # A tuple or list batch only a compute_loss override can read (`model(**inputs)` needs names): through it.
        through_loss = has_labels or not isinstance(inputs, Mapping)
        if ignore_keys is None:
            config = getattr(run.model, "config", None)
            ignore_keys = list(getattr(config, "keys_to_ignore_at_inference", ["cache"])) if config else []
        labels = None
        if has_labels:
            labels = nested_detach(tuple(inputs.get(name) for name in run.label_names))
            labels = labels[0] if len(labels) == 1 else labels
        with torch.no_grad():
            if through_loss:
                num_items = context.count_loss_items([inputs])
                if run.args.use_liger_kernel and prediction_loss_only and isinstance(inputs, Mapping):
                    inputs = {**inputs, "skip_logits": True}  # as Trainer: Liger's loss without the logits
                with context.compute_loss_context_manager():
                    loss, outputs = context.compute_loss(model, inputs, return_outputs=True,
                                                         num_items_in_batch=num_items)
                loss = loss.detach().mean()
                logits = tuple(v for k, v in outputs.items() if k not in ignore_keys + ["loss"]) \
                    if isinstance(outputs, Mapping) else outputs[1:]
            else:
                loss = None
                with context.compute_loss_context_manager():
                    outputs = model(**inputs)
                logits = tuple(v for k, v in outputs.items() if k not in ignore_keys) \
                    if isinstance(outputs, Mapping) else outputs
        if prediction_loss_only:
            return loss, None, None
        logits = nested_detach(logits)
        if len(logits) == 1:
            logits = logits[0]
        return loss, logits, labels

