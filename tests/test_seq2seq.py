"""`Seq2SeqLoop` against `transformers.Seq2SeqTrainer`, run live on a tiny T5 built from a config: the same training
losses, then `evaluate()` / `predict()` with `predict_with_generate=True`, `generation_max_length`,
`generation_num_beams`, a `generation_config` and `generate` keywords give the same generated tokens, labels, losses
and `compute_metrics` results, and `generate` is called with the same keywords."""

import numpy as np
import pytest
import torch

from loopkit import Loop, LoopConfigError, Seq2SeqEvalStage, Seq2SeqLoop

from helpers import IGNORE_PIN_MEMORY_WARNING

WORDS = "red green blue cat dog bird one two three four big small up down left right".split()
PAD, EOS = 0, 1  # T5's pad (also the decoder's start token) and end-of-sequence ids
RTOL = 1e-6


def tokenizer():
    """A word-level `PreTrainedTokenizerFast` (offline) with T5's special ids: <pad> 0, </s> 1, appended EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "</s>", "<unk>"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_t5(vocab_size: int):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(
        vocab_size=vocab_size, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=PAD))


def copy_rows(n: int, seed: int, tok, labelled: bool = True):
    """A `datasets.Dataset` of 2-to-5-word sentences, whose first two words are the target: uneven lengths."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(torch.randint(2, 6, (1,), generator=g)),),
                                                      generator=g)]
        row = {"input_ids": tok(" ".join(words))["input_ids"]}
        if labelled:
            row["labels"] = tok(" ".join(words[:2]))["input_ids"]
        rows.append(row)
    return Dataset.from_list(rows)


def compute_metrics(eval_pred):
    """Exact match and token accuracy of generated ids (after the decoder's start token) against the labels."""
    preds, labels = np.asarray(eval_pred.predictions)[:, 1:], np.asarray(eval_pred.label_ids)
    labels = np.where(labels == -100, PAD, labels)
    width = max(preds.shape[1], labels.shape[1])
    preds = np.pad(preds, ((0, 0), (0, width - preds.shape[1])), constant_values=PAD)
    labels = np.pad(labels, ((0, 0), (0, width - labels.shape[1])), constant_values=PAD)
    counted, equal = labels != PAD, preds == labels
    return {"token_accuracy": float(equal[counted].mean()), "exact_match": float((equal | ~counted).all(1).mean())}


def seq2seq_args(output_dir, **overrides):
    from transformers import GenerationConfig, Seq2SeqTrainingArguments

    settings = dict(per_device_train_batch_size=4, per_device_eval_batch_size=3, max_steps=16, learning_rate=1e-2,
                    logging_steps=4, save_strategy="no", report_to="none", disable_tqdm=True,
                    predict_with_generate=True, generation_max_length=6, generation_num_beams=2,
                    generation_config=GenerationConfig(max_length=9, decoder_start_token_id=PAD, eos_token_id=EOS,
                                                       pad_token_id=PAD))
    return Seq2SeqTrainingArguments(output_dir=str(output_dir), **{**settings, **overrides})


def record_generate_calls(model) -> list:
    """Wrap the model's `generate` to record each call's non-tensor keywords (what the trainer chose)."""
    calls, generate = [], model.generate

    def recorded(*args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)})
        return generate(*args, **kwargs)

    model.generate = recorded
    return calls


def run_seq2seq(runner, output_dir) -> dict:
    """Train, then evaluate twice (the arguments' generation settings, then `generate` keywords) and predict on a
    labelled and an unlabelled set; everything the comparison needs."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

    tok = tokenizer()
    model = tiny_t5(len(tok))
    calls = record_generate_calls(model)
    trainer = runner(model=model, args=seq2seq_args(output_dir), data_collator=DataCollatorForSeq2Seq(tok, model=model),
                     train_dataset=copy_rows(24, 0, tok), eval_dataset=copy_rows(7, 1, tok),
                     processing_class=tok, compute_metrics=compute_metrics)
    trainer.train()
    out = {"losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
           "eval": trainer.evaluate(),
           "eval_kwargs": trainer.evaluate(metric_key_prefix="short", max_new_tokens=3, num_beams=1),
           "predict": trainer.predict(copy_rows(6, 2, tok))}
    out["generation_config"] = model.generation_config.to_dict()
    out["batch_losses"] = batch_losses(model, DataCollatorForSeq2Seq(tok, model=model), copy_rows(7, 1, tok), 3)
    # An unlabelled set through DataCollatorForSeq2Seq gives `labels: None`, on which HF 5.24 calls the model with
    # neither labels nor decoder inputs and fails: the comparison uses a padding collator (a second trainer, same
    # trained model); loopkit's own run with DataCollatorForSeq2Seq must give the same tokens.
    unlabelled = copy_rows(4, 3, tok, labelled=False)
    padded = runner(model=model, args=seq2seq_args(output_dir), data_collator=DataCollatorWithPadding(tok),
                    processing_class=tok)
    out["unlabelled"] = padded.predict(unlabelled, max_length=4)
    if runner is Seq2SeqLoop:
        out["unlabelled_seq2seq_collator"] = trainer.predict(unlabelled, max_length=4)
    out["calls"] = calls
    return out


def batch_losses(model, collator, rows, batch_size: int) -> list[float]:
    """The model's loss on each evaluation batch, computed directly."""
    model.eval()
    with torch.no_grad():
        return [model(**collator([rows[i] for i in range(start, min(start + batch_size, len(rows)))])).loss.item()
                for start in range(0, len(rows), batch_size)]


def without_speed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))}


@IGNORE_PIN_MEMORY_WARNING
def test_seq2seq_loop_matches_seq2seq_trainer(tmp_path):
    from transformers import Seq2SeqTrainer

    runs = {}
    for name, runner in (("hf", Seq2SeqTrainer), ("loopkit", Seq2SeqLoop)):  # build, then train: one at a time
        runs[name] = run_seq2seq(runner, tmp_path / name)
    hf, mine = runs["hf"], runs["loopkit"]
    assert len(hf["losses"]) == 4
    np.testing.assert_allclose(mine["losses"], hf["losses"], rtol=RTOL)

    # generate's keywords: the arguments' max_length / num_beams, then the given ones (eval: 3 batches each; predict: 2)
    assert hf["calls"][0] == {"max_length": 6, "num_beams": 2, "synced_gpus": False}
    assert hf["calls"][3] == {"max_new_tokens": 3, "num_beams": 1, "synced_gpus": False}
    assert hf["calls"][-1] == {"max_length": 4, "num_beams": 2, "synced_gpus": False}
    assert mine["calls"][:-2] == hf["calls"] and len(hf["calls"]) == 3 + 3 + 2 + 2
    assert mine["calls"][-2:] == [{"labels": None, **hf["calls"][-1]}] * 2  # the collator's `labels: None`

    for key, prefix in (("eval", "eval"), ("eval_kwargs", "short")):
        assert without_speed(mine[key]).keys() == without_speed(hf[key]).keys()
        for metric, value in without_speed(hf[key]).items():
            if metric != f"{prefix}_loss":
                assert mine[key][metric] == pytest.approx(value, rel=RTOL), f"{key}: {metric}"
        # The loss (7 samples in batches of 3, 3, 1): loopkit weighs each batch by its size, as Trainer does;
        # Seq2SeqTrainer gathers without gather_for_metrics' truncation and weighs the last batch as a full one.
        a, b, c = mine["batch_losses"]
        np.testing.assert_allclose(mine["batch_losses"], hf["batch_losses"], rtol=RTOL)
        assert mine[key][f"{prefix}_loss"] == pytest.approx((3 * a + 3 * b + c) / 7, rel=RTOL)
        assert hf[key][f"{prefix}_loss"] == pytest.approx((a + b + c) / 3, rel=RTOL)
    assert hf["eval"]["eval_token_accuracy"] > 0  # the metric sees real generated tokens

    for key in ("predict", "unlabelled"):
        # generated ids padded to the generation config's max_length (9): the tokens themselves must be equal
        assert hf[key].predictions.shape[1] == 9
        np.testing.assert_array_equal(mine[key].predictions, hf[key].predictions)
        assert without_speed(mine[key].metrics).keys() == without_speed(hf[key].metrics).keys()
    np.testing.assert_array_equal(mine["predict"].label_ids, hf["predict"].label_ids)
    for metric, value in without_speed(hf["predict"].metrics).items():  # 6 samples, 2 full batches: the same loss
        assert mine["predict"].metrics[metric] == pytest.approx(value, rel=RTOL), metric
    assert mine["unlabelled"].label_ids is None and hf["unlabelled"].label_ids is None
    np.testing.assert_array_equal(mine["unlabelled_seq2seq_collator"].predictions, hf["unlabelled"].predictions)
    # the arguments' generation config replaced the model's, completed with generate's defaults (as HF does)
    assert hf["generation_config"]["max_length"] == 9
    assert mine["generation_config"] == hf["generation_config"]


def test_a_plain_loop_refuses_predict_with_generate(tmp_path):
    tok = tokenizer()
    with pytest.raises(LoopConfigError, match=r"predict_with_generate=True: the evaluation stage EvalStage does "
                                              r"not generate\. Fix: replace Loop\( with Seq2SeqLoop\("):
        Loop(tiny_t5(len(tok)), seq2seq_args(tmp_path))


def test_a_seq2seq_loop_subclass_overrides_prediction_step_and_super_generates(tmp_path):
    """The migration of a `Seq2SeqTrainer` subclass: its `prediction_step` override runs, `super()` generates with
    the keywords given, and the generating stage is not mistaken for a conflicting override."""
    from transformers import DataCollatorForSeq2Seq

    seen = []

    class Recording(Seq2SeqLoop):
        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
            seen.append(type(self).__name__)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys, max_new_tokens=2)

    tok = tokenizer()
    model = tiny_t5(len(tok))
    loop = Recording(model, seq2seq_args(tmp_path), data_collator=DataCollatorForSeq2Seq(tok, model=model),
                     processing_class=tok)
    assert isinstance(loop.evaluation, Seq2SeqEvalStage)
    output = loop.predict(copy_rows(4, 3, tok, labelled=False))
    assert seen == ["Recording", "Recording"]  # batches of 3 and 1
    # max_new_tokens=2: the start token and at most two more, padded to the generation config's max_length (9)
    assert output.predictions.shape == (4, 9) and (output.predictions[:, 3:] == PAD).all()


def test_generation_config_loads_from_an_object_a_directory_or_a_file_and_is_validated(tmp_path):
    from transformers import GenerationConfig

    from loopkit.stages.seq2seq import load_generation_config

    given = GenerationConfig(max_length=7, num_beams=3, decoder_start_token_id=PAD)
    given.save_pretrained(tmp_path / "dir")
    copied = Seq2SeqLoop.load_generation_config(given)
    assert copied is not given and copied.to_dict() == given.to_dict()
    for source in (str(tmp_path / "dir"), str(tmp_path / "dir" / "generation_config.json")):
        loaded = load_generation_config(source)
        assert (loaded.max_length, loaded.num_beams, loaded.decoder_start_token_id) == (7, 3, PAD), source
    with pytest.raises(ValueError, match="Fix these issues"):  # num_beams=1 with early_stopping: strict refuses
        load_generation_config(GenerationConfig(num_beams=1, early_stopping=True))


def test_generation_needs_a_pad_token_and_refuses_streaming_metrics(tmp_path):
    from loopkit import TokenAccuracy

    tok = tokenizer()
    with pytest.raises(LoopConfigError, match=r"metrics=\['TokenAccuracy'\]: streaming metrics read logits"):
        Seq2SeqLoop(tiny_t5(len(tok)), seq2seq_args(tmp_path), metrics=[TokenAccuracy()])
    model = tiny_t5(len(tok))
    model.config.pad_token_id = None
    loop = Seq2SeqLoop(model, seq2seq_args(tmp_path))  # no processing class: the model config's pad token
    with pytest.raises(LoopConfigError, match="pad_token_id=None: generated tokens and labels are padded"):
        loop.predict([{"input_ids": torch.tensor([3, 4, EOS])}])
