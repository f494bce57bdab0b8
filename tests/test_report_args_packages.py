"""loopkit/report.py and loopkit/args.py became packages of one module per job (issue 35, section 4): every name users
and loopkit imported from the one module still imports from the package, and a name of an earlier version
(`loopkit.report.wait_for_charts`) answers with what replaces it."""

import runpy
import sys

import pytest

import loopkit
import loopkit.args
import loopkit.report

# Every module-level name of loopkit/report.py and loopkit/args.py before the split (read from the last one-module
# version with `ast`): each must still import from the package.
REPORT_NAMES = [
    "BOUNDED_METRIC_WORDS", "CHARTS_HINT", "CHART_TITLES", "EVAL_SKIP", "METRIC_CHARTS", "PHASES", "PhaseClock",
    "REBUILT_NAME", "REPORT_NAME", "RUN_ENDS", "RUN_RECORD_KEY", "RunReport", "STARVED_SHARE", "STATUS_JSON",
    "TRAINING_LOG_KEYS", "build_report", "change_text", "chart_figure", "chart_names", "charts_drawn",
    "charts_in_memory", "charts_on_demand", "compile_record", "cpu_starvation", "draw_charts", "duration_text",
    "eval_metric_keys", "evaluation_title", "interruption_lines", "interruption_record", "is_bounded_metric",
    "is_current", "learning_rate_chart", "loss_chart", "lr_schedule_settings", "main", "mark_resumes",
    "matplotlib_missing", "metric_charts", "peak_device_memory_mb", "peak_host_memory_mb", "planned_charts",
    "read_json", "rebuilt_end", "report_from_checkpoint", "report_from_files", "report_markdown", "run_record",
    "schedule_rates", "seconds_text", "segment_lines", "series", "slow_step_lines", "starvation_lines",
    "starvation_text", "step_metric_keys", "summary_text", "throughput", "throughput_chart", "time_by_phase",
    "whole_run_totals", "write_atomically", "write_report", "write_run_status",
]
ARGS_NAMES = [
    "ACCELERATE_ENGINE_FIELDS", "DICT_FIELDS", "ENUM_OF_FIELD", "FIXES", "INERT_FIELDS", "LOOP_ARGS_FIELDS",
    "LoopArgs", "LoopConfigError", "MetricNotFoundError", "RuntimeConfigError", "SEQ2SEQ_FIELDS",
    "SUPPORTED_CHOICES", "SUPPORTED_FIELDS", "UnknownArgumentError", "check_args", "check_best_model_schedule",
    "check_inputs", "check_intervals", "check_optim", "check_tf32", "check_training_options",
    "check_unsupported_fields", "config_error", "enum_refusal", "nearest", "plain", "refusal",
    "reject_unknown_keywords", "report_to_list", "trainer_error", "trainer_field_names", "transformers_quiet",
    "unknown_argument_error", "unsupported_field_error",
]


@pytest.mark.parametrize("package, names", [(loopkit.report, REPORT_NAMES), (loopkit.args, ARGS_NAMES)],
                         ids=["report", "args"])
def test_every_name_of_the_one_module_imports_from_the_package(package, names):
    missing = []
    for name in names:
        try:
            exec(f"from {package.__name__} import {name}", {})
        except ImportError:
            missing.append(name)
    assert missing == []


def test_loop_args_from_loopkit_is_the_one_of_loopkit_args():
    from loopkit import LoopArgs

    assert LoopArgs is loopkit.args.LoopArgs is loopkit.args.loop_args.LoopArgs
    assert loopkit.args.check_args is loopkit.args.checks.check_args


def test_wait_for_charts_answers_with_what_replaces_it():
    """`from loopkit.report import wait_for_charts` (documented until charts were drawn on demand) and the attribute
    both raise an ImportError that says there is nothing to wait for and how to get the charts."""
    with pytest.raises(ImportError) as raised:
        from loopkit.report import wait_for_charts  # noqa: F401
    message = str(raised.value)
    assert "loopkit.report.wait_for_charts was removed" in message
    assert "python -m loopkit report OUTPUT_DIR" in message and "TeardownStage(charts=True)" in message
    with pytest.raises(ImportError, match="nothing to wait for"):
        loopkit.report.wait_for_charts()
    assert not hasattr(loopkit.report, "no_such_name")  # any other unknown name: a plain AttributeError


def test_python_m_loopkit_report_runs_the_report_command(tmp_path, monkeypatch, capsys):
    """`python -m loopkit report DIR` (loopkit/__main__.py, run here as `-m` runs it) reaches the report's command
    line: a folder with nothing to report is refused with the report's own message, in one line, exit status 2."""
    monkeypatch.setattr(sys, "argv", ["loopkit", "report", str(tmp_path)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("loopkit", run_name="__main__")
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert f"{tmp_path} holds neither run_report.json nor an undamaged checkpoint: nothing to report" in said
    assert "Traceback" not in said and said.count("\n") == 1
