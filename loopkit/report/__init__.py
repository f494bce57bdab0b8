"""The run report: where the time went, how fast it ran, what it reached, and charts of it.

The time by phase comes from the phase clock (`PhaseClock`, loopkit/phases.py).

At the end of a run (and when it fails or is interrupted) the teardown stage writes `run_report.json` and
`run_report.md` to the output folder (each atomically: a temporary file, renamed; not forced to disk) and prints a
one-screen summary, all before `train()` returns or raises: no thread of loopkit's writes into the user's folder
afterwards, and every file the summary names exists when it is printed. That costs about a millisecond. The PNG
charts (loss with eval loss, the best checkpoint and resumes; the learning rate as the schedule set it, warmup
shaded; one axis per evaluation metric; one per key a step observer adds to the training logs, loopkit/observers/;
throughput) take about a second of matplotlib, most of a short run, so they are drawn on demand from what the report
records: `python -m loopkit report RUN_DIR` writes them into the folder, and a notebook's `loop.report` shows them
inline (drawn in memory, nothing written). `TeardownStage(charts=True)` draws them before `train()` returns instead
(timed in the "report" phase). Without matplotlib the report says how to get the charts.

Slow steps: a step slower than 3x the rolling median and beyond the run's normal spread (median + 5 robust standard
deviations, from the median absolute deviation), its scheduled evaluation and checkpoint left out. Each names its
phases, the load average and the process's share of a CPU during it, so a step slowed by other processes on a busy
machine reads as such; the report also says when the machine was busy over the run (load average above the cores),
and when a run on the CPU got far less CPU than torch's threads asked for (`cpu_starvation`): the threads, cores,
load and CPU share, and how to set fewer threads. The teardown stage also logs that advice once, at the first
training or evaluation log that measures it, so a long run says it when it is first known.

Each checkpoint carries a run record (`run_record()`, under "run_record" in `loopkit_state.json`): the elapsed time
and phase totals of every stretch of training so far (one per resume), the metric settings, the learning-rate
schedule's settings and how busy the machine was. A resumed run's report covers the whole run from it.
`python -m loopkit report RUN_DIR` prints the run's own report when it covers the newest checkpoint (by save numbers,
never file times), else rebuilds one from that checkpoint, its status from `run_status.json` (how the latest
`train()` ended, or "running" if it never did), and writes it beside the run's own (`--force`: over it); either way
it draws the charts. Time a killed run spent after its last checkpoint is in no file.

The package, one module per job (each imports only the ones before it):
- `charts.py`: the PNG charts, drawn into the folder or in memory;
- `text.py`: the one-screen summary and the Markdown of a notebook;
- `files.py`: `run_report.json` / `.md` and `run_status.json`, written atomically and read back;
- `record.py`: the run record a checkpoint carries, and the report of a live run (`build_report`, `RunReport`);
- `rebuild.py`: a report rebuilt from a run's folder and its newest checkpoint;
- `cli.py`: `python -m loopkit report RUN_DIR`.
Every name is importable from `loopkit.report` too, as when it was one module.
"""

from ..phases import PHASES, PhaseClock  # noqa: F401  (loopkit.report.PHASES, as before)
from .charts import (BOUNDED_METRIC_WORDS, CHART_TITLES, CHARTS_HINT, EVAL_SKIP, METRIC_CHARTS,  # noqa: F401
                     TRAINING_LOG_KEYS, change_text, chart_figure, chart_names, charts_drawn, charts_in_memory,
                     charts_on_demand, draw_charts, eval_metric_keys, is_bounded_metric, learning_rate_chart,
                     loss_chart, mark_resumes, matplotlib_missing, metric_charts, planned_charts, schedule_rates,
                     series, step_metric_keys, throughput, throughput_chart)
from .cli import main  # noqa: F401
from .files import REBUILT_NAME, REPORT_NAME, STATUS_JSON, read_json, write_atomically, write_report  # noqa: F401
from .files import write_run_status  # noqa: F401
from .rebuild import is_current, rebuilt_end, report_from_checkpoint, report_from_files  # noqa: F401
from .record import (RUN_ENDS, RUN_RECORD_KEY, STARVED_SHARE, RunReport, build_report, compile_record,  # noqa: F401
                     cpu_starvation, interruption_record, lr_schedule_settings, peak_device_memory_mb,
                     peak_host_memory_mb, run_record, time_by_phase, whole_run_totals)
from .text import (duration_text, evaluation_title, interruption_lines, report_markdown, seconds_text,  # noqa: F401
                   segment_lines, slow_step_lines, starvation_lines, starvation_text, summary_text)

# Names of earlier versions that are gone, with what to write instead.
REMOVED = {
    "wait_for_charts": "train() no longer draws the charts in a background thread, so there is nothing to wait for "
                       "(remove the call). The charts are drawn on demand: `python -m loopkit report OUTPUT_DIR` "
                       "draws them into the folder, `loop.report` shows them in a notebook, and "
                       "`Loop(..., teardown=TeardownStage(charts=True))` draws them before train() returns",
}


def __getattr__(name):
    """A removed name answers with its replacement. An `ImportError`, also for `loopkit.report.NAME`: Python turns an
    `AttributeError` raised here into a bare "cannot import name" for `from loopkit.report import NAME`."""
    if name in REMOVED:
        raise ImportError(f"loopkit.report.{name} was removed: {REMOVED[name]}.", name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
