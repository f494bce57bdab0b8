"""loopkit: an explicit training loop for PyTorch and Hugging Face models, with HF Trainer's arguments and events.

`from loopkit import Loop` and replace `Trainer(` with `Loop(`. Names are imported on first use, so `import loopkit`
stays cheap (it never imports `transformers.trainer`).
"""

__version__ = "0.1.0"

from . import moved

_EXPORTS = {
    "Loop": "loopkit.loop",
    "LoopArgs": "loopkit.args",
    "LoopConfigError": "loopkit.errors",
    "LoopState": "loopkit.state",
    "LoopControl": "loopkit.state",
    "EvalPrediction": "loopkit.state",
    "TrainOutput": "loopkit.state",
    "PredictionOutput": "loopkit.state",
    "EvalLoopOutput": "loopkit.state",
    "Stage": "loopkit.stages.base",
    "SetupStage": "loopkit.stages.setup",
    "DataStage": "loopkit.stages.data",
    "StepStage": "loopkit.stages.step",
    "PackingDataStage": "loopkit.stages.packing",
    "ChunkedLossStep": "loopkit.stages.chunked_loss",
    "use_per_text_attention": "loopkit.per_text_attention",
    "EvalStage": "loopkit.stages.evaluation",
    "TeardownStage": "loopkit.stages.teardown",
    "EMA": "loopkit.averaging",
    "SWA": "loopkit.averaging",
    "Seq2SeqLoop": "loopkit.seq2seq_loop",
    "Seq2SeqEvalStage": "loopkit.stages.seq2seq",
    "EVENTS": "loopkit.events",
    "Checkpointer": "loopkit.storage.hf",
    "CheckpointStorage": "loopkit.storage",
    "HFStorage": "loopkit.storage",
    "DCPStorage": "loopkit.storage",
    "EarlyStopping": "loopkit.callbacks",
    "Metric": "loopkit.metrics",
    "Accuracy": "loopkit.metrics",
    "TokenAccuracy": "loopkit.metrics",
    "Perplexity": "loopkit.metrics",
    "PrecisionRecallF1": "loopkit.metrics",
    "TrainingInterrupted": "loopkit.guards",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

# Module paths of earlier versions (`loopkit.run`, `loopkit.hub`, ...) import their new module, with a warning.
moved.register()


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'loopkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
