"""The README's Python examples run as printed, and the two ways it shows to change the loss do the same thing.

The README's first example starts from `model_dir`, `train_ds` and `eval_ds`; here they are a tiny BERT saved with
MiniLM's real tokenizer, and a few real Rotten Tomatoes reviews.
"""

import os
import re

import pytest
from helpers import minilm_tokenizer, rotten_tomatoes

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
    assert len(readme_python_blocks()) == 4, "README's Python examples changed: update tests/test_readme.py"


def test_readme_examples_run_and_both_loss_overrides_agree(readme_inputs):
    first_example, step_stage, pass_stage, loop_subclass = readme_python_blocks()
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
