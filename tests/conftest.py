"""Test environment: no network (models are built from small configs or come from installed packages), no tokenizer
thread pools fighting pytest's, and transformers' logging kept to errors so test output stays readable."""

import os

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
