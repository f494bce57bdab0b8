"""Export a trained model: a `save_pretrained` folder, a `torch.export` program, an ONNX file.

Exports take any batch size and sequence length: the batch dimension of every input and the sequence dimension of
token inputs are dynamic (`torch.export` dims, which the ONNX exporter turns into named dynamic axes), the sequence
up to the model's maximum positions. Each exporter then checks its result against the live model on the example
and on other shapes (batch 1 and a shorter sequence; a larger batch and a longer one) and returns the largest
absolute difference, so an export that does not reproduce the model fails here, not in production. A model that
cannot be exported with a dynamic sequence (say, a layer sized for the example's length) is exported with a dynamic
batch only, and failing that with the example's fixed shape, with a warning that names the shape it accepts.

`torch.export` replaces TorchScript tracing (deprecated in torch 2.13). ONNX needs the `onnx`, `onnxscript` and
`onnxruntime` packages (`pip install onnx onnxscript onnxruntime`); without them, or for a model the exporter cannot
capture, the error says so.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch

FORMATS = ("pretrained", "torch_export", "onnx")
MAX_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length")


class ExportError(RuntimeError):
    """An export that could not be made or does not reproduce the model; the message says which and why."""


def first_output(outputs) -> torch.Tensor:
    """The main output tensor: `.logits` of a `ModelOutput`, else the first tensor."""
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, dict):
        return next(v for v in outputs.values() if isinstance(v, torch.Tensor))
    if isinstance(outputs, (list, tuple)):
        return outputs[0]
    return outputs


def reference_output(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return first_output(model(**inputs)).detach().cpu()


# -- shapes ------------------------------------------------------------------------------------------------------
def max_positions(model) -> int | None:
    config = getattr(model, "config", None)
    for name in MAX_POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def sequence_inputs(model, inputs: dict) -> list[str]:
    """The inputs whose dimension 1 is the sequence: those as long as the main input, when that holds token ids
    (an image's dimension 1 is its channels)."""
    name = getattr(model, "main_input_name", "input_ids")
    main = inputs.get(name)
    if not isinstance(main, torch.Tensor) or main.ndim < 2 or main.dtype.is_floating_point:
        return []
    length = main.shape[1]
    return [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.ndim >= 2 and v.shape[1] == length]


def resized(inputs: dict, batch: int, length: int | None, sequence_names: list[str]) -> dict:
    """The inputs with `batch` rows (and `length` positions in the sequence inputs), repeating the example's rows
    and positions cyclically."""
    out = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            value = value[torch.arange(batch) % value.shape[0]]
            if length is not None and name in sequence_names:
                value = value[:, torch.arange(length) % value.shape[1]]
        out[name] = value
    return out


@dataclass
class ShapePlan:
    """One way to export: which dimensions are dynamic, the inputs to capture with, and the shapes to check on."""

    dynamic: tuple  # ("batch", "sequence"), ("batch",) or ()
    dynamic_shapes: dict | None
    capture_inputs: dict
    checks: list = field(default_factory=list)


def shape_plans(model, inputs: dict) -> list[ShapePlan]:
    """Fully dynamic first, then a dynamic batch only, then the example's fixed shape."""
    from torch.export import Dim

    names = sequence_inputs(model, inputs)
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim >= 1]
    if not tensors:
        return [ShapePlan((), None, inputs, [inputs])]
    batch = tensors[0].shape[0]
    length = inputs[names[0]].shape[1] if names else None
    limit = max_positions(model)
    plans = []
    if names and (limit is None or limit >= 2):
        longer = length + 3 if limit is None else min(length + 3, limit)
        dims = {"batch": Dim("batch", min=1), "sequence": Dim("sequence", min=1, max=limit)}
        shapes = {k: ({0: dims["batch"], 1: dims["sequence"]} if k in names else
                      {0: dims["batch"]} if isinstance(v, torch.Tensor) and v.ndim >= 1 else None)
                  for k, v in inputs.items()}
        # Captured with at least 2 rows and positions: torch.export fixes a dimension of size 1 to 1.
        plans.append(ShapePlan(("batch", "sequence"), shapes, resized(inputs, max(batch, 2), max(length, 2), names),
                               [inputs, resized(inputs, 1, max(1, length - 3), names),
                                resized(inputs, batch + 1, longer, names)]))
    batch_dim = Dim("batch", min=1)
    shapes = {k: {0: batch_dim} if isinstance(v, torch.Tensor) and v.ndim >= 1 else None for k, v in inputs.items()}
    plans.append(ShapePlan(("batch",), shapes, resized(inputs, max(batch, 2), None, names),
                           [inputs, resized(inputs, 1, None, names), resized(inputs, batch + 1, None, names)]))
    plans.append(ShapePlan((), None, inputs, [inputs]))
    return plans


def shape_text(inputs: dict) -> str:
    return ", ".join(f"{k} {' x '.join(map(str, v.shape))}" for k, v in inputs.items()
                     if isinstance(v, torch.Tensor))


def checked_export(what: str, model, inputs: dict, build) -> float:
    """Export through `build(plan) -> run(inputs) -> tensor` with the most dynamic plan that captures the model and
    reproduces it on that plan's shapes; warn when that is not fully dynamic. Returns max |difference|."""
    plans = shape_plans(model, inputs)
    failures = []
    for plan in plans:
        try:
            run = build(plan)
            diff = max(float((run(x) - reference_output(model, x)).abs().max()) for x in plan.checks)
            break
        except Exception as exc:
            if not plan.dynamic:  # the last plan: the example's own shape
                raise ExportError(f"{what} could not export {type(model).__name__}: {type(exc).__name__}: "
                                  f"{str(exc)[:300]}") from exc
            reason = " ".join(str(exc).split())[:200]  # one line
            failures.append(f"dynamic {' and '.join(plan.dynamic)}: {type(exc).__name__}: {reason}")
    if failures:
        accepted = "any batch size, the sequence fixed" if plan.dynamic else "only the example's shape"
        warnings.warn(f"{what} could not export {type(model).__name__} with dynamic shapes ({'; '.join(failures)}). "
                      f"Fell back: the export accepts {accepted} ({shape_text(inputs)}).")
    return diff


# -- the formats -------------------------------------------------------------------------------------------------
def export_pretrained(model, output_dir: str, example_inputs: dict, processing_class=None) -> tuple[str, float]:
    """`save_pretrained` (safetensors + config [+ tokenizer]) reloaded with the model's class: max |diff| on the
    example and other shapes."""
    if not hasattr(model, "save_pretrained"):
        raise ExportError(f"{type(model).__name__} has no save_pretrained(): export it as 'torch_export' instead.")
    model.save_pretrained(output_dir)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
    reloaded = type(model).from_pretrained(output_dir).eval()
    return output_dir, checked_export("save_pretrained", model, example_inputs,
                                      lambda plan: lambda x: reference_output(reloaded, x))


def export_torch(model, output_dir: str, example_inputs: dict) -> tuple[str, float]:
    """A `torch.export` program saved as `model.pt2`, reloaded and run: max |diff| on the example and other
    shapes."""
    path = os.path.join(output_dir, "model.pt2")

    def build(plan: ShapePlan):
        program = torch.export.export(model, args=(), kwargs=plan.capture_inputs, dynamic_shapes=plan.dynamic_shapes)
        torch.export.save(program, path)
        loaded = torch.export.load(path).module()
        return lambda x: reference_output(loaded, x)

    return path, checked_export("torch.export", model, example_inputs, build)


def export_onnx(model, output_dir: str, example_inputs: dict) -> tuple[str, float]:
    """`model.onnx` through the dynamo exporter, run with onnxruntime: max |diff| on the example and other
    shapes."""
    try:
        import onnxruntime
        import onnxscript  # noqa: F401  (the exporter needs it)
    except ImportError as exc:
        raise ExportError(f"ONNX export needs onnx, onnxscript and onnxruntime ({exc.name} is missing): "
                          f"pip install onnx onnxscript onnxruntime") from exc
    path = os.path.join(output_dir, "model.onnx")

    def build(plan: ShapePlan):
        with warnings.catch_warnings():  # the exporter's notes on merging axis names that share a Dim
            warnings.filterwarnings("ignore", message=".*axis name.*will not be used")
            torch.onnx.export(model, (), path, kwargs=plan.capture_inputs, dynamic_shapes=plan.dynamic_shapes,
                              dynamo=True, verbose=False)
        session = onnxruntime.InferenceSession(path)
        names = [i.name for i in session.get_inputs()]
        return lambda x: torch.from_numpy(session.run(None, {n: x[n].cpu().numpy() for n in names})[0])

    return path, checked_export("The ONNX exporter", model, example_inputs, build)


def export_model(model, output_dir: str, example_inputs: dict, formats=("pretrained",),
                 processing_class=None) -> dict:
    """Export `model` (in eval mode, on the CPU) in each of `formats`; returns {format: (path, max |diff|)}, the
    difference to the live model over the example and the other shapes each export was checked on."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ExportError(f"Unknown export format(s) {unknown}: choose from {FORMATS}.")
    os.makedirs(output_dir, exist_ok=True)
    model = model.eval().to("cpu")
    inputs = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in example_inputs.items()}
    exporters = {"pretrained": lambda: export_pretrained(model, output_dir, inputs, processing_class),
                 "torch_export": lambda: export_torch(model, output_dir, inputs),
                 "onnx": lambda: export_onnx(model, output_dir, inputs)}
    return {fmt: exporters[fmt]() for fmt in formats}
