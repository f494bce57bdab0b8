"""Test environment: no network (models are built from small configs or come from installed packages), no tokenizer
thread pools fighting pytest's, and transformers' logging kept to errors so test output stays readable."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers  # noqa: E402  (after the environment above, which transformers reads at import)

transformers.logging.set_verbosity_error()

import torch  # noqa: E402

# The test models are tiny: intra-op threads only add synchronisation, and on a shared 2-core machine their spin-waits
# made steps 10-30x slower. One thread also makes the timing of the suite independent of the machine's load.
torch.set_num_threads(1)


def pytest_collection_finish(session):
    """Freeze the objects of the imported modules (torch, transformers, loopkit) out of the garbage collector's
    view: every `train()` starts with Accelerate's `free_memory()`, whose `gc.collect()` otherwise walks all of them
    (~0.2 s each time, and the parity tests train dozens of times). Garbage the tests make is still collected."""
    import gc

    gc.freeze()


# ---------------------------------------------------------------------------------------------------------------
# Test tiers (docs/testing.md): `pytest -m "not slow"` is the fast tier (`make test`), plain `pytest` runs everything
# (`make test-all`, .ci/run). A test is slow when a list below names it: its file, or its function (all parameters).
# tests/test_no_wallclock.py refuses a test that launches a process and is in neither list, so none lands in the fast
# tier unnoticed.
# ---------------------------------------------------------------------------------------------------------------
TESTS = os.path.dirname(os.path.abspath(__file__))
SLOW_LISTS = ("load_sensitive.txt", "slow.txt")


def listed_ids(name: str) -> list[str]:
    """The test ids a list names: the first word of each line that is not blank or a comment."""
    with open(os.path.join(TESTS, name), encoding="utf-8") as f:
        return [line.split()[0] for line in f if line.strip() and not line.lstrip().startswith("#")]


def slow_ids() -> set[str]:
    return {test_id for name in SLOW_LISTS for test_id in listed_ids(name)}


def is_listed(nodeid: str, ids: set[str]) -> bool:
    """Whether `nodeid` (tests/test_x.py::Class::test_y[param]) or a prefix of it (its file, its class, its function
    with every parameter) is in `ids`."""
    parts = nodeid.split("[")[0].split("::")
    return any("::".join(parts[:end]) in ids for end in range(1, len(parts) + 1))


def pytest_collection_modifyitems(config, items):
    ids = slow_ids()
    for item in items:
        if is_listed(item.nodeid, ids):
            item.add_marker(pytest.mark.slow)
    items[:] = longest_files_first(items)


# The slow tier's files that take longest, longest first (each file's summed test times in a whole slow-tier run,
# docs/testing.md). The Makefile runs the tests on pytest-xdist workers that take one file at a time, in this
# collection order (`--no-loadscope-reorder`): when a long file started last, the other worker sat idle until it
# ended (test_ray_train.py, unlisted, once ran alone for the last 400 of 2,240 s). The other files follow, those
# with most tests first (xdist's own order).
LONGEST_FILES = ("test_ray_train.py", "test_elastic.py", "test_benchmarks_smoke.py", "test_trl_dpo.py",
                 "test_dcp_storage.py", "test_trl_sft.py", "test_deepspeed.py", "test_fsdp.py", "test_trl_grpo.py",
                 "test_bench_trl.py", "test_kill_and_preempt.py", "test_rng_order.py", "test_async_staging.py",
                 "test_stand_in_callbacks.py", "test_weight_averaging.py", "test_trl_engines.py",
                 "test_hf_async_fsdp2.py", "test_reshard_resume.py", "test_parallelism.py", "test_distributed.py",
                 "test_process_exit.py", "test_node_local_disks.py", "test_on_save_commit.py", "test_demo.py",
                 "test_run_fields.py", "test_files_settle.py")


def longest_files_first(items: list) -> list:
    """`items` with the files of LONGEST_FILES first, in that order, then the others by their number of tests."""
    counts = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def rank(item):
        name = item.path.name
        listed = LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)
        return listed, -counts[name], str(item.path)

    return sorted(items, key=rank)


# ---------------------------------------------------------------------------------------------------------------
# Child scripts as forks of one process that has imported what they import (helpers.ForkServer): the kill, preempt
# and interrupt tests start dozens of children, each of which would otherwise spend ~5 s of CPU on the same imports.
# ---------------------------------------------------------------------------------------------------------------
CHILD_IMPORTS = ["torch", "safetensors.torch", "transformers", "transformers.trainer_callback",
                 "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert", "loopkit",
                 "loopkit.loop"]


@pytest.fixture(scope="session")
def forked():
    """A `helpers.ForkServer` for the session (started by the first test that asks; the fast tier never does). Every
    child gets one intra-op thread (tiny matrices: threads only contend) and unbuffered output (a killed child's last
    lines are in its output), on top of the test process's environment."""
    from helpers import ForkServer

    server = ForkServer(CHILD_IMPORTS, overrides=dict(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    yield server
    server.close()
