"""Benchmark 10, chunked loss memory: peak host memory of one loopkit training step of a causal LM with a large
vocabulary (128,256, Llama 3's) at sequence 512, with the model's own loss vs `ChunkedLossStep`
(docs/packing.md).

Each measurement is a fresh process: a 1-layer, 64-wide Llama (the vocabulary's embedding and head are nearly all
of it), one sample, SGD, one step. Measured: the step's peak resident set above the resident set just before
`train()` (the peak mark is reset there through /proc/self/clear_refs; where it cannot be, the lifetime peak above
the lifetime peak before), read at the step's end by a callback (the run report's charts come later and are not
counted). Both runs must log the same loss. Processes run two at a time: peak memory is their own, whatever runs
beside them.
"""

from __future__ import annotations

from ..reports.verdicts import check_equal, comparison_row, median, paired_ratio

MODULE = "benchmarks.suite.chunked_loss"
TITLE = "Chunked loss: peak memory of one training step at a 128k vocabulary (loopkit)"
RUNS = {"unchunked": "the model's own loss (full logits)", "chunked": "ChunkedLossStep()"}


def plan(suite) -> dict:
    return {"vocab": suite.pick(128256, 128256, 4096), "seq": suite.pick(512, 512, 64),
            "rounds": suite.pick(3, 2, 1)}


# ---------------------------------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------------------------------
def one_step(run_name: str, vocab: int, seq: int, output_dir: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from loopkit import ChunkedLossStep, Loop, LoopArgs

    from .eval_memory import current_rss_mb, peak_rss_mb, reset_peak_rss

    class PeakAtStepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            self.peak = peak_rss_mb(self.reset)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=seq)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (seq,))
    args = LoopArgs(output_dir=output_dir, max_steps=1, per_device_train_batch_size=1, report_to="none",
                    disable_tqdm=True, save_strategy="no", optim="sgd", logging_steps=1)
    peak = PeakAtStepEnd()
    loop = Loop(model, args, train_dataset=[{"input_ids": ids, "labels": ids}], callbacks=[peak],
                **({"step": ChunkedLossStep()} if run_name == "chunked" else {}))
    peak.reset = reset_peak_rss()
    before = current_rss_mb() if peak.reset else peak_rss_mb(False)
    loop.train()
    loss = [h["loss"] for h in loop.state.log_history if "loss" in h][0]
    return {"name": run_name, "step_peak_mb": peak.peak - before, "loss": loss, "peak_was_reset": peak.reset}


# ---------------------------------------------------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------------------------------------------------
def run(suite) -> dict:
    settings = plan(suite)
    jobs = [(f"chunked-loss-{name}-{index}", MODULE, "one_step",
             {"run_name": name, "vocab": settings["vocab"], "seq": settings["seq"],
              "output_dir": suite.scratch_dir(f"chunked-loss-{name}-{index}")})
            for index in range(settings["rounds"]) for name in RUNS]
    suite.say(f"chunked_loss: {len(jobs)} one-step runs at vocabulary {settings['vocab']:,}, sequence "
              f"{settings['seq']}")
    replies = suite.fresh_many(jobs)
    runs = {name: [r for r in replies if r["name"] == name] for name in RUNS}
    check = check_equal({name: median([r["loss"] for r in runs[name]]) for name in RUNS}, 1e-5, "logged loss")
    samples = {name: [r["step_peak_mb"] for r in runs[name]] for name in RUNS}
    row = comparison_row(f"peak memory of one step, vocabulary {settings['vocab']:,}, sequence {settings['seq']}",
                         "MB", samples, check)
    row["noisy"] = row["untrusted"] = []  # memory: no timing noise rule (the rounds are in the row)
    return {"title": TITLE, "plan": settings, "runs": runs, "rows": [row],
            "ratio": paired_ratio(samples["chunked"], samples["unchunked"])}


def markdown(section: dict) -> str:
    from ..reports.tables import with_range
    from ..reports.verdicts import fmt, fmt_comparison

    row = section["rows"][0]
    lines = ["| run | what | peak memory of the step, MB | logged loss |", "|---|---|---|---|"]
    for name, what in RUNS.items():
        lines.append(f"| {name} | {what} | {with_range(row['median'][name], row['samples'][name])} | "
                     f"{fmt(median([r['loss'] for r in section['runs'][name]]), 6)} |")
    return "\n".join(lines + ["", f"chunked / unchunked, round by round: "
                                  f"{fmt_comparison(section['ratio'], 'amount', '')}. {row['check']['detail']}."])


def chart(section: dict, plt):
    return None  # one number per run: the table says it
