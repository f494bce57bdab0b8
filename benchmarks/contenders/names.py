"""The contenders' names, labels and the peers' packages.

Imported by the parent process too, so it stays free of torch and transformers.
"""

from __future__ import annotations


# The three contenders, in the order they alternate within a round (A B C A B C ...).
CONTENDERS = ("raw", "hf", "loopkit")


# The other frameworks the per-step benchmark runs beside them (contenders/peers.py), after them in each round.
# Installed for the benchmarks only (loopkit's `bench` extra), never a dependency of loopkit.
PEERS = ("ignite", "fabric", "lightning")


LABELS = {"raw": "hand-written PyTorch", "hf": "HF Trainer", "loopkit": "loopkit Loop", "ignite": "pytorch-ignite",
          "fabric": "Lightning Fabric", "lightning": "Lightning Trainer"}


# (module a peer imports, the package that installs it)
PEER_PACKAGES = {"ignite": ("ignite", "pytorch-ignite"), "fabric": ("lightning", "lightning"),
                 "lightning": ("lightning", "lightning")}


def missing_peers() -> dict:
    """{peer: why it cannot run} for each peer whose package is not importable here (the workers share this
    interpreter and path). Finds the module without importing it: the parent stays free of torch."""
    import importlib.util

    return {peer: f"{package} is not installed (pip install -e '.[bench]')"
            for peer, (module, package) in PEER_PACKAGES.items() if importlib.util.find_spec(module) is None}
