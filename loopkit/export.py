"""Export a trained model: a `save_pretrained` folder, a `torch.export` program, an ONNX file.

Each exporter checks its result against the live model on the example inputs and returns the largest absolute
difference, so an export that does not reproduce the model fails here, not in production. `torch.export` replaces
TorchScript tracing (deprecated in torch 2.13). ONNX needs the `onnx`, `onnxscript` and `onnxruntime` packages
(`pip install onnx onnxscript onnxruntime`); without them, or for a model the exporter cannot capture, the error
says so.
"""

from __future__ import annotations

import os

import torch

FORMATS = ("pretrained", "torch_export", "onnx")


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


def reference_output(model, example_inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return first_output(model(**example_inputs)).detach().cpu()


def export_pretrained(model, output_dir: str, example_inputs: dict, processing_class=None) -> tuple[str, float]:
    """`save_pretrained` (safetensors + config [+ tokenizer]) reloaded with `AutoModel...`'s class: max |diff|."""
    if not hasattr(model, "save_pretrained"):
        raise ExportError(f"{type(model).__name__} has no save_pretrained(): export it as 'torch_export' instead.")
    model.save_pretrained(output_dir)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
    reloaded = type(model).from_pretrained(output_dir).eval()
    diff = (reference_output(reloaded, example_inputs) - reference_output(model, example_inputs)).abs().max()
    return output_dir, float(diff)


def export_torch(model, output_dir: str, example_inputs: dict) -> tuple[str, float]:
    """A `torch.export` program saved as `model.pt2`, reloaded and run: max |diff|."""
    path = os.path.join(output_dir, "model.pt2")
    try:
        program = torch.export.export(model, args=(), kwargs=example_inputs)
    except Exception as exc:
        raise ExportError(f"torch.export could not capture {type(model).__name__}: {type(exc).__name__}: "
                          f"{str(exc)[:300]}") from exc
    torch.export.save(program, path)
    with torch.no_grad():
        exported = first_output(torch.export.load(path).module()(**example_inputs)).detach().cpu()
    return path, float((exported - reference_output(model, example_inputs)).abs().max())


def export_onnx(model, output_dir: str, example_inputs: dict) -> tuple[str, float]:
    """`model.onnx` through the dynamo exporter, run with onnxruntime: max |diff|."""
    try:
        import onnxruntime
        import onnxscript  # noqa: F401  (the exporter needs it)
    except ImportError as exc:
        raise ExportError(f"ONNX export needs onnx, onnxscript and onnxruntime ({exc.name} is missing): "
                          f"pip install onnx onnxscript onnxruntime") from exc
    path = os.path.join(output_dir, "model.onnx")
    try:
        torch.onnx.export(model, (), path, kwargs=example_inputs, dynamo=True, verbose=False)
    except Exception as exc:
        raise ExportError(f"The ONNX exporter could not convert {type(model).__name__}: {type(exc).__name__}: "
                          f"{str(exc)[:300]}") from exc
    session = onnxruntime.InferenceSession(path)
    names = [i.name for i in session.get_inputs()]
    feeds = {name: example_inputs[name].cpu().numpy() for name in names}
    exported = torch.from_numpy(session.run(None, feeds)[0])
    return path, float((exported - reference_output(model, example_inputs)).abs().max())


def export_model(model, output_dir: str, example_inputs: dict, formats=("pretrained",),
                 processing_class=None) -> dict:
    """Export `model` (in eval mode, on the CPU) in each of `formats`; returns {format: (path, max |diff|)}."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ExportError(f"Unknown export format(s) {unknown}: choose from {FORMATS}.")
    os.makedirs(output_dir, exist_ok=True)
    model = model.eval().to("cpu")
    inputs = {k: v.to("cpu") for k, v in example_inputs.items()}
    exporters = {"pretrained": lambda: export_pretrained(model, output_dir, inputs, processing_class),
                 "torch_export": lambda: export_torch(model, output_dir, inputs),
                 "onnx": lambda: export_onnx(model, output_dir, inputs)}
    return {fmt: exporters[fmt]() for fmt in formats}
