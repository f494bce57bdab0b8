"""The code in the README and docs/ runs as printed, and does what the text says it does.

Convention for the fenced blocks of README.md and docs/*.md, checked here:
- ```python blocks run in these tests, in page order, each page continuing the README's first example;
- ```bash (shell commands) and ```text (pictures) blocks are not Python, and are not run here;
- any other block, e.g. ```py for Python that cannot run here, has `<!-- not run: the reason -->` on the line
  right above it.

The README's first example starts from `model_dir`, `train_ds` and `eval_ds`; here they are a tiny BERT saved with
MiniLM's real tokenizer, and a few real Rotten Tomatoes reviews.
"""

import glob
import os
import re
import warnings

import pytest
from helpers import minilm_tokenizer, numpy_accuracy, numpy_prf1, rotten_tomatoes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
README_MAX_BYTES = 12 * 1024  # a landing page: the reference material lives in docs/

# How many ```python blocks each page has, all run by the tests below: a new block needs a test here.
# (docs/stages.md's blocks 4 and 5, the step observers, run in tests/test_observers.py)
PYTHON_BLOCKS_RUN_HERE = {"README.md": 1, "docs/stages.md": 5, "docs/evaluation.md": 4, "docs/arguments.md": 1,
                          "docs/events.md": 1,  # events.md: run in tests/test_on_save_commit.py
                          "docs/trl.md": 5,
                          "docs/weight-averaging.md": 1,  # run in tests/test_weight_averaging.py
                          "docs/packing.md": 1}  # packing.md: run in tests/test_per_text_attention.py
# trl.md's: tests/test_trl_{sft,dpo,reward,grpo}.py, test_config_refusal.py
NOT_PYTHON = {"bash", "text"}
NOT_RUN_MARK = re.compile(r"<!-- not run: (\S.*?) -->")
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)


def read_page(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def fenced_blocks(page: str) -> list[tuple[str, str, str]]:
    """(language, code, the line right above the fence) for every fenced block of the page."""
    text = read_page(page)
    blocks = []
    for match in FENCE.finditer(text):
        above = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((match.group(1), match.group(2), above))
    return blocks


def python_blocks(page: str) -> list[str]:
    return [code for language, code, _ in fenced_blocks(page) if language == "python"]


def python_block(page: str, marker: str) -> str:
    """The one Python block of `page` that contains `marker` (a test that runs it fails if there are more or none)."""
    blocks = [code for code in python_blocks(page) if marker in code]
    assert len(blocks) == 1, f"{page}: {len(blocks)} Python blocks contain {marker!r}, one expected"
    return blocks[0]


def run_python_block(page: str, marker: str, namespace: dict | None = None) -> dict:
    """Run `python_block(page, marker)` as printed (in the current folder); returns the names it defined."""
    namespace = {} if namespace is None else namespace
    exec(compile(python_block(page, marker), page, "exec"), namespace)
    return namespace


def test_every_python_block_is_run_by_these_tests():
    counts = {page: len(python_blocks(page)) for page in DOC_PAGES if python_blocks(page)}
    assert counts == PYTHON_BLOCKS_RUN_HERE, "a page's Python examples changed: run the new ones in tests/test_docs.py"


@pytest.mark.parametrize("page", DOC_PAGES)
def test_every_block_that_is_not_run_says_why(page):
    for language, code, above in fenced_blocks(page):
        marked = NOT_RUN_MARK.fullmatch(above.strip())
        where = f"{page}: the block starting {code.splitlines()[0]!r}"
        if language == "python":
            assert not marked, f"{where} is ```python (run by the tests) but marked not run"
        elif language not in NOT_PYTHON:
            assert marked, (f"{where} is ```{language}: make it ```python and run it in tests/test_docs.py, or put "
                            f"`<!-- not run: the reason -->` on the line above it")


def heading_anchors(page: str) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", read_page(page))
    headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", DOC_PAGES)
def test_links_between_pages_resolve(page):
    folder = os.path.dirname(os.path.join(ROOT, page))
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", read_page(page))):
        if re.match(r"https?:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = os.path.normpath(os.path.join(folder, path)) if path else os.path.join(ROOT, page)
        assert os.path.exists(linked), f"{page} links to {target}, which does not exist"
        if anchor:
            assert anchor in heading_anchors(os.path.relpath(linked, ROOT)), f"{page}: no heading for {target}"


def test_readme_is_a_landing_page():
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size < README_MAX_BYTES, f"README.md is {size} bytes: move reference material into a docs/ page"


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


def test_first_example_and_both_loss_overrides_on_the_stages_page_agree(readme_inputs):
    (first_example,) = python_blocks("README.md")
    step_stage, pass_stage, loop_subclass = python_blocks("docs/stages.md")[:3]
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


def test_streaming_metrics_example_matches_numpy(readme_inputs):
    """The streaming-metrics example, with the tokenizer as processing_class (so the batches are `BatchEncoding`s
    from DataCollatorWithPadding), gives the numbers numpy computes from `predict()` on the trained model."""
    (first_example,) = python_blocks("README.md")
    streaming_example = python_blocks("docs/evaluation.md")[0]
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

def test_custom_metric_example_gives_the_mean_absolute_error_of_predict(readme_inputs):
    """docs/evaluation.md's `MeanAbsoluteError` on a one-output regression head, over an uneven last batch
    (16 reviews in batches of 5), equals the mean absolute error numpy computes from `predict()`."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification, TrainingArguments

    from loopkit import Loop

    namespace = {}
    exec(python_blocks("docs/evaluation.md")[1], namespace)
    tokenizer = AutoTokenizer.from_pretrained(readme_inputs["model_dir"])
    torch.manual_seed(0)
    regressor = BertForSequenceClassification(BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, num_labels=1))
    eval_ds = [{**example, "labels": float(example["labels"])} for example in readme_inputs["eval_ds"]]
    args = TrainingArguments("runs/mae", per_device_eval_batch_size=5, report_to="none")
    loop = Loop(model=regressor, args=args, eval_dataset=eval_ds, processing_class=tokenizer,
                metrics=[namespace["MeanAbsoluteError"]()])
    mae = loop.evaluate()["eval_mae"]
    prediction = loop.predict(eval_ds)
    assert prediction.predictions.shape == (16, 1)
    expected = np.abs(prediction.predictions[:, 0].astype(np.float64) - prediction.label_ids).mean()
    assert mae == pytest.approx(expected, rel=1e-6)


def test_best_total_limit_example_keeps_the_newest_checkpoint_and_the_three_best(readme_inputs):
    (first_example,) = python_blocks("README.md")
    namespace = dict(readme_inputs)
    exec(first_example, namespace)
    exec(python_blocks("docs/evaluation.md")[2], namespace)
    f1_at = {log["step"]: log["eval_f1"] for log in namespace["loop"].state.log_history if "eval_f1" in log}
    assert sorted(f1_at) == [2, 4, 6, 8, 10, 12]
    kept = {int(name.split("-")[1]) for name in os.listdir(os.path.join("runs", "best"))
            if name.startswith("checkpoint-")}
    best = kept - {12}
    assert 12 in kept and len(best) == 3, f"kept checkpoints {sorted(kept)}, eval_f1 by step {f1_at}"
    dropped = set(f1_at) - kept
    assert min(f1_at[step] for step in best) >= max(f1_at[step] for step in dropped), f"{sorted(kept)}, {f1_at}"


def test_early_stopping_example_stops_after_three_evaluations_under_five_percent(readme_inputs):
    """Continuing the first example for up to 20 more epochs, evaluated on its training reviews (so the loss keeps
    falling, by less and less), the example's `EarlyStopping` stops at the first evaluation that ends 3 in a row
    without a relative improvement above 5% of the best eval_loss so far."""
    from transformers import TrainingArguments

    (first_example,) = python_blocks("README.md")
    namespace = dict(readme_inputs)
    exec(first_example, namespace)
    namespace["eval_ds"] = namespace["train_ds"]
    namespace["args"] = TrainingArguments("runs/early", num_train_epochs=20, learning_rate=1e-3, eval_strategy="epoch",
                                          save_strategy="epoch", load_best_model_at_end=True, report_to="none")
    exec(python_blocks("docs/evaluation.md")[3], namespace)
    namespace["loop"].train()
    losses = [log["eval_loss"] for log in namespace["loop"].state.log_history if "eval_loss" in log]

    best, without_improvement, expected_evaluations, lower_but_under_threshold = None, 0, None, 0
    for count, loss in enumerate(losses, start=1):
        improved = best is None or (best - loss) / abs(best) > 0.05
        lower_but_under_threshold += not improved and loss < best
        without_improvement = 0 if improved else without_improvement + 1
        best = loss if best is None else min(best, loss)
        if without_improvement == 3:
            expected_evaluations = count
            break
    assert expected_evaluations is not None and expected_evaluations < 20, losses
    assert len(losses) == expected_evaluations, losses
    assert lower_but_under_threshold > 0, f"the 5% threshold never mattered here: {losses}"


# ---------------------------------------------------------------------------------------------------------------
# docs/stages.md's label-smoothing stage gives the gradients of Trainer's label_smoothing_factor, at any accumulation
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


def test_label_smoothing_stage_gives_trainer_gradients_at_any_accumulation(tmp_path):
    from transformers import Trainer

    from helpers import hf_args
    from loopkit import Loop

    namespace = {}
    exec(python_blocks("docs/stages.md")[0], namespace)
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


def test_benchmark_numbers_in_the_docs_are_generated_from_the_committed_results_files():
    """README.md's and docs/performance.md's benchmark numbers sit in generated sections (issue 22): each one is
    rendered again here from the results file its section names, and must match the page character for character
    (`python -m benchmarks.reports.docs` rewrites them after a new run)."""
    import sys

    if ROOT not in sys.path:  # `benchmarks/` lives in the repository, next to the installed loopkit
        sys.path.insert(0, ROOT)
    from benchmarks.reports.docs import PAGES, SECTION, render

    sections = {page: [m["name"] for m in SECTION.finditer(read_page(page))] for page in PAGES}
    assert sections == {"README.md": ["ladder-headline"],
                        "docs/performance.md": ["ladder-headline", "environment", "summary", "overhead-interleaved",
                                                "overhead-grid", "overhead-peers", "trl", "ladder", "ladder-profile",
                                                "storage", "compile", "optimizer-step", "durations", "durations",
                                                "durations"],
                        "docs/packing.md": ["chunked-loss"], "docs/evaluation.md": ["eval-memory"],
                        "docs/trl.md": ["trl-headline"]}
    for page in PAGES:
        text = read_page(page)
        assert render(text) == text, f"{page}: its benchmark numbers differ from the results files"
    from benchmarks.reports.docs import RESULTS_PAGES, results_markdown

    for page in RESULTS_PAGES:  # the committed results.md, by today's verdict rules, from its results.json
        assert results_markdown(page) == read_page(page), f"{page} differs: run python -m benchmarks.reports.docs"


def test_a_quick_run_resolves_every_generated_number_and_the_headline_spans_every_dataset():
    """The committed quick run (`python -m benchmarks --quick`) has every row the generated sections read, so a
    fresh quick run can regenerate the docs; the ladder's headline has a clause per dataset, with its command."""
    import json
    import sys

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from benchmarks import BENCHMARKS
    from benchmarks.reports.docs import BENCHMARK_OF, GENERATORS, LADDER_RESULTS, OWN_COMMAND, SEPARATE_RUN, \
        ladder_headline, ladder_sections

    def results_of(path):
        with open(os.path.join(ROOT, path)) as f:
            return json.load(f)

    quick = results_of(LADDER_RESULTS)
    assert quick["environment"]["size"] == "quick"
    missing = [name for name in BENCHMARKS
               if name not in SEPARATE_RUN and "error" in quick["benchmarks"].get(name, {"error": "absent"})]
    assert not missing, (f"{LADDER_RESULTS} has no (or a failed) {', '.join(missing)}: run `make bench BENCH_ARGS="
                         f"\"--quick --out benchmarks/results/quick\"` and `python -m benchmarks.reports.docs`")
    for name, generate in GENERATORS.items():
        if name not in OWN_COMMAND:  # e.g. benchmarks/results/storage.json: bench_storage's own command
            separate = SEPARATE_RUN.get(BENCHMARK_OF.get(name, name))  # e.g. bench_trl's own run folder
            assert generate(results_of(separate) if separate else quick), name
    assert [section["plan"]["dataset"] for _, section in ladder_sections(quick)] == ["reviews", "debates", "hamlet"]
    headline = ladder_headline(quick)
    for benchmark in ("ladder", "ladder_debates", "ladder_hamlet"):
        assert f"`python -m benchmarks --only {benchmark} --quick`" in headline


def benchmarks_importable():
    import sys

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)


def test_the_compile_tables_state_each_comparison_with_its_rounds_and_a_verdict_only_where_all_agree():
    """benchmarks/reports/docs.py's compile and optimizer-step sections, from a section built by bench_compile's own
    summary: the buckets' ratio to the collator's padding with every round above 1 reads "slower in all 2 rounds", a
    ratio whose rounds straddle 1 gets no verdict, "slower in 6 of 7 rounds" counts the rounds, and the count of
    recompilations under a schedule is the section's."""
    benchmarks_importable()
    from types import SimpleNamespace

    from benchmarks.suite import compile as bench_compile
    from benchmarks.reports.docs import compile_runs, optimizer_step

    full = SimpleNamespace(size="full", pick=lambda full, quick, tiny=None: full)
    settings = bench_compile.plan(full)

    def runs(*steps, compilations=2, seconds=60.0):
        return [{"median_step_ms": ms, "compilations": compilations, "compile_seconds": seconds,
                 "training_loss": 5.0} for ms in steps]

    replies = {"eager": runs(280.0, 300.0, compilations=0, seconds=0.0), "compiled": runs(270.0, 310.0),
               "buckets": runs(378.0, 527.0), "buckets-static": runs(250.0, 350.0, compilations=3)}

    def optimizer(*steps, parameters=37_000):
        return [{"median_step_ms": ms, "first_call_seconds": 19.0, "parameters": parameters, "checksum": 1.0}
                for ms in steps]

    fused = [0.2] * 7
    optimizers = {"small": {"fused": optimizer(*fused), "foreach": optimizer(*[0.8] * 7),
                            "compiled": optimizer(0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.1)}}
    section = bench_compile.summarize(settings, replies, optimizers, recompiles=5)
    env = {"size": "full", "started_at": "2026-12-01 10:00:00 +0000", "load_average": {"start": 1.0, "end": 1.0},
           "cpu_count": 2}
    results = {"environment": env, "benchmarks": {"compile": section}}
    table = compile_runs(results)
    assert "| compiled, buckets of 64 | 2 | 60.0 (60.0-60.0) | 452 (378-527) | 1.553x (1.35-1.76), slower in all 2 " \
           "rounds | 1.550x (1.40-1.70), slower in all 2 rounds |" in table
    assert "| compiled, the collator's padding | 2 | 60.0 (60.0-60.0) | 290 (270-310) | 0.999x (0.96-1.03), rounds " \
           "point both ways: no verdict |  |" in table
    assert "| compiled, buckets of 64, `ACCELERATE_DYNAMO_USE_DYNAMIC=0` | 3 |" in table
    assert "`python -m benchmarks --only compile`" in table and "Same work: equal training loss" in table
    steps = optimizer_step(results)
    assert "| small | 0.04 M | 0.2 (0.2-0.2) | 0.8 (0.8-0.8) | 0.5 (0.1-0.5) | 2.500x (0.50-2.50), rounds point both ways: no verdict " \
           "(slower in 6 of 7 rounds) |" in steps
    assert "dynamo compiled the step 5 times in 20 steps." in steps


def test_the_chunked_loss_sentence_and_a_section_the_results_file_lacks(monkeypatch):
    """docs/packing.md's sentence gives both runs' medians with their rounds and the round-by-round ratio; a
    section whose benchmark the results file lacks says so and names the command, instead of failing or keeping
    old numbers."""
    benchmarks_importable()
    from benchmarks.suite import chunked_loss as bench_chunked_loss
    from benchmarks.reports.docs import chunked_loss, render
    from benchmarks.reports.verdicts import check_equal, comparison_row, paired_ratio

    samples = {"unchunked": [770.0, 760.0], "chunked": [141.0, 206.0]}
    check = check_equal({"unchunked": 10.0, "chunked": 10.0}, 1e-5, "logged loss")
    section = {"plan": {"vocab": 128256, "seq": 512, "rounds": 2},
               "rows": [comparison_row("peak", "MB", samples, check)],
               "ratio": paired_ratio(samples["chunked"], samples["unchunked"])}
    env = {"size": "quick", "started_at": "then", "load_average": {"start": 1.0, "end": 2.0}, "cpu_count": 2}
    text = chunked_loss({"environment": env, "benchmarks": {"chunked_loss": section}})
    assert "765 (760-770) MB unchunked, 174 (141-206) MB chunked, chunked / unchunked round by round 0.227x " \
           "(0.18-0.27), the same loss." in text
    assert "`python -m benchmarks --only chunked_loss --quick`" in text
    assert set(bench_chunked_loss.RUNS) == set(samples)
    page = ("<!-- generated: chunked-loss from benchmarks/results/quick/results.json -->\nold text\n"
            "<!-- end generated: chunked-loss -->")
    import benchmarks.reports.docs as docs

    monkeypatch.setattr(docs, "load", lambda path: {"environment": env, "benchmarks": {}})
    rendered = render(page)
    assert "old text" not in rendered
    assert "Not measured yet: `benchmarks/results/quick/results.json` has no `chunked_loss` section." in rendered


def test_arguments_page_refuses_a_subclass_field_until_the_loop_declares_it(capsys):
    """docs/arguments.md: `MyArgs`' field is refused by a plain Loop, with the fix, and read by `MyLoop`."""
    (block,) = python_blocks("docs/arguments.md")
    namespace = {}
    exec(block, namespace)
    printed = capsys.readouterr().out
    assert "loss_scale=0.5: MyArgs's fields are read by your own code, and Loop does not read them" in printed
    assert "`class MyLoop(Loop): args_class = MyArgs`" in printed


def test_trl_page_refuses_an_sft_config_on_a_plain_loop():
    """docs/trl.md's "Configs and columns loopkit refuses" block (it asserts the refusal itself)."""
    pytest.importorskip("trl")
    (block,) = [code for code in python_blocks("docs/trl.md") if "use loopkit.trl.SFTLoop" in code]
    exec(block, {})

