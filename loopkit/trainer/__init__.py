"""Trainer's surface: what makes a `Loop` answer as `transformers.Trainer` does, beside the run itself.

A newcomer reading the core (loop.py, the stages, the schedule, the checkpoint storage) can skip this package: it
holds HF's overridable methods routed to their stages (`overridable`), the rest of Trainer's public methods
(`methods`), the Hub (`hub`), the hyper-parameter search (`search`), the notebook display and `repr` (`notebook`),
`show_wiring()`'s text (`wiring_text`), and Trainer's log messages (`log_messages`, the one module the stages use,
so it sits in a lower layer: docs/architecture.md). This `__init__` imports nothing, so importing one of them does
not import the others.
"""
