"""Names that moved, answering at their old place: an old module path imports the new module, with a
`DeprecationWarning` naming it; an old name raises or warns with its new place.

`import loopkit` registers `MovedModules` first on `sys.meta_path`: it answers only for the old paths, which no
file of the package has (first, so that an editable install's finder, which maps `loopkit.*` to a source tree, does
not find a stale file there).
`MOVED_MODULES` is the one list of old module paths; docs/architecture.md's map shows where each module is now.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import warnings

# old module path -> where it lives now
MOVED_MODULES = {
    "loopkit.run": "loopkit.run_state",
    "loopkit.packing": "loopkit.row_packing",
    "loopkit.seq2seq": "loopkit.seq2seq_loop",
    "loopkit.hf_methods": "loopkit.trainer.overridable",
    "loopkit.trainer_api": "loopkit.trainer.methods",
    "loopkit.trainer_logging": "loopkit.trainer.log_messages",
    "loopkit.hub": "loopkit.trainer.hub",
    "loopkit.search": "loopkit.trainer.search",
    "loopkit.notebook": "loopkit.trainer.notebook",
    "loopkit.wiring": "loopkit.trainer.wiring_text",
}


def moved_warning(old: str, new: str, stacklevel: int) -> None:
    """`stacklevel`: of the user's line, counted from the caller (importlib's own frames are skipped)."""
    warnings.warn(f"{old} moved to {new}; import it from there (the old path will be removed)", DeprecationWarning,
                  stacklevel=stacklevel + 1)


def moved_name(old_module: str, name: str, new_module: str):
    """`name`, looked up in `old_module` where it no longer is: warn, and return it from `new_module`."""
    moved_warning(f"{old_module}.{name}", f"{new_module}.{name}", stacklevel=3)  # past the module's __getattr__
    return getattr(importlib.import_module(new_module), name)


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path (`MOVED_MODULES`) as the module that now holds its code: the very same module
    object, so a name patched through either path is patched for both."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        moved_warning(spec.name, MOVED_MODULES[spec.name], stacklevel=2)
        return importlib.import_module(MOVED_MODULES[spec.name])

    def exec_module(self, module) -> None:
        pass  # the module it returned is already executed


def register() -> None:
    import sys

    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
