"""The README's Python examples run as printed, and the two ways it shows to change the loss do the same thing.

The README's first example starts from `model_dir`, `train_ds` and `eval_ds`; here they are a tiny BERT saved with
MiniLM's real tokenizer, and a few real Rotten Tomatoes reviews.
"""

import os
import re
import warnings

import pytest
from helpers import minilm_tokenizer, numpy_accuracy, numpy_prf1, rotten_tomatoes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)  # ```py blocks are illustrations, not run


@pytest.fixture
def readme_inputs(tmp_path, monkeypatch):
    """The names the README's first example assumes, with the working directory in a temporary folder."""
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = minilm_tokenizer()
    model_dir = str(tmp_path / "tiny-bert")
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    examples = [{**tokenizer(text, truncation=True, max_length=32), "labels": label}
                for text, label in rotten_tomatoes(48)]
    monkeypatch.chdir(tmp_path)
    return {"model_dir": model_dir, "train_ds": examples[:32], "eval_ds": examples[32:]}


def test_readme_has_the_examples_this_test_runs():
    assert len(readme_python_blocks()) == 5, "README's Python examples changed: update tests/test_readme.py"


def test_readme_examples_run_and_both_loss_overrides_agree(readme_inputs):
    first_example, step_stage, pass_stage, loop_subclass, _ = readme_python_blocks()
    namespace = dict(readme_inputs)

    exec(first_example, namespace)
    trained = namespace["loop"]
    assert trained.state.global_step > 0
    assert os.path.isdir(os.path.join("runs", "example"))
    plain_loss = trained.evaluate()["eval_loss"]

    # The stage swap takes effect: on the same trained model, the label-smoothed loss differs from the plain one.
    exec(step_stage, namespace)
    exec(pass_stage, namespace)
    swapped = namespace["loop"]
    assert isinstance(swapped.step, namespace["LabelSmoothingStep"])
    smoothed_loss = swapped.evaluate()["eval_loss"]
    assert smoothed_loss != pytest.approx(plain_loss)

    # The Loop-subclass style computes exactly the same loss on the same model and data.
    exec(loop_subclass, namespace)
    subclassed = namespace["LabelSmoothingLoop"](model=namespace["model"], args=namespace["args"],
                                                 eval_dataset=namespace["eval_ds"],
                                                 processing_class=namespace["tokenizer"])
    assert subclassed.evaluate()["eval_loss"] == pytest.approx(smoothed_loss, rel=1e-6)


def test_readme_streaming_metrics_example_matches_numpy(readme_inputs):
    """The streaming-metrics example, with the tokenizer as processing_class (so the batches are `BatchEncoding`s
    from DataCollatorWithPadding), gives the numbers numpy computes from `predict()` on the trained model."""
    first_example, *_, streaming_example = readme_python_blocks()
    namespace = dict(readme_inputs)
    exec(first_example, namespace)
    exec(streaming_example, namespace)
    metrics = namespace["metrics"]
    prediction = namespace["loop"].predict(namespace["eval_ds"])
    expected = {"accuracy": numpy_accuracy(prediction.predictions, prediction.label_ids),
                **numpy_prf1(prediction.predictions, prediction.label_ids, num_classes=2)}
    assert len(expected) == 10
    for key, value in expected.items():
        assert metrics[f"eval_{key}"] == pytest.approx(value, rel=1e-9), f"eval_{key}"

# ---------------------------------------------------------------------------------------------------------------
# The README's label-smoothing stage gives the gradients of Trainer's label_smoothing_factor, at any accumulation
# ---------------------------------------------------------------------------------------------------------------
def tiny_bert_classifier():
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config).double()  # float64: the comparison sees the math, not rounding


def six_samples():
    import torch

    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(1, 50, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": torch.tensor(i % 3)} for i in range(6)]


def first_step_gradients(runner, args, **kwargs) -> dict:
    """Every parameter's gradient at the first optimizer step (no clipping), from a callback."""
    from transformers import TrainerCallback

    grads = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            if not grads:
                grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})

    runner(model=tiny_bert_classifier(), args=args, train_dataset=six_samples(), callbacks=[Grab()], **kwargs).train()
    return grads


def test_readme_label_smoothing_stage_gives_trainer_gradients_at_any_accumulation(tmp_path):
    from transformers import Trainer

    from helpers import hf_args
    from loopkit import Loop

    namespace = {}
    exec(readme_python_blocks()[1], namespace)
    stage = namespace["LabelSmoothingStep"]
    common = dict(max_steps=1, max_grad_norm=0.0, learning_rate=1e-3, seed=3)
    hf = first_step_gradients(Trainer, hf_args(tmp_path / "hf", per_device_train_batch_size=2,
                                               gradient_accumulation_steps=3, label_smoothing_factor=0.1, **common))
    ga3 = first_step_gradients(Loop, hf_args(tmp_path / "ga3", per_device_train_batch_size=2,
                                             gradient_accumulation_steps=3, **common), step=stage())
    ga1 = first_step_gradients(Loop, hf_args(tmp_path / "ga1", per_device_train_batch_size=6,
                                             gradient_accumulation_steps=1, **common), step=stage())
    assert set(hf) == set(ga3) == set(ga1)
    for name in hf:
        assert torch_allclose(ga3[name], hf[name]), f"{name}: loopkit GA 3 vs Trainer label_smoothing_factor=0.1"
        assert torch_allclose(ga3[name], ga1[name]), f"{name}: GA 3 x 2 vs GA 1 x 6"


def torch_allclose(a, b) -> bool:
    import torch

    return torch.allclose(a, b, rtol=1e-5, atol=1e-8)


def test_an_override_under_the_already_scaled_rule_is_never_silent(tmp_path):
    import torch

    from helpers import hf_args
    from loopkit import Loop, StepStage

    class PerBatchMean(StepStage):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**{k: v for k, v in inputs.items() if k != "labels"})
            loss = torch.nn.functional.cross_entropy(outputs.logits, inputs["labels"])
            return (loss, outputs) if return_outputs else loss

    args = hf_args(tmp_path / "undeclared", per_device_train_batch_size=2, gradient_accumulation_steps=3, max_steps=1)
    with pytest.warns(UserWarning, match="set loss_is_scaled_for_ga = False"):
        Loop(model=tiny_bert_classifier(), args=args, train_dataset=six_samples(), step=PerBatchMean()).train()

    class DeclaredPerBatchMean(PerBatchMean):
        loss_is_scaled_for_ga = False

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        args.output_dir = str(tmp_path / "declared")  # a folder of its own: a rerun next to checkpoints warns
        Loop(model=tiny_bert_classifier(), args=args, train_dataset=six_samples(),
             step=DeclaredPerBatchMean()).train()
