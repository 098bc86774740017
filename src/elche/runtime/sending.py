"""What a local run sends its rank processes: the user's functions and data, pickled.

Rules:

- A rank process starts from the fork server (or is spawned) and rebuilds the
  caller's main module the way ``multiprocessing`` does: it imports it again
  from the script's file, or by name under ``python -m``. What the script
  defines at its top level then goes by reference, as plain ``pickle`` sends it.
- Where no file or name gives the ranks that module (a notebook, the REPL,
  ``python -c``), the functions and classes it defines go by value instead
  (cloudpickle's reducers, whose bytes plain ``pickle.loads`` reads): a
  function written in a notebook cell trains as one in a script does.
  Everything else is pickled as plain ``pickle`` does (a lambda of a module
  is refused as ever: ``elche.runtime.options.check_sendable``).
- A main module read from standard input (``python - < train.py``) names a
  file that does not exist: every process the fork server starts would fail
  to rebuild it, the coordinator first. ``check_main_module`` refuses it up
  front, saying what to do.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import types
from typing import Any

import cloudpickle

from elche.core.errors import ConfigError

__all__ = ["SEND_ERRORS", "check_main_module", "to_ranks"]

# What pickling an object that cannot be sent raises (a lambda, an open file, a lock).
SEND_ERRORS = (pickle.PicklingError, AttributeError, TypeError)


def _main_file() -> str | None:
    """The file the rank processes rebuild the caller's main module from; "" where
    they import it by name (``python -m``), None where from nothing (a notebook)."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return ""
    path = getattr(main, "__file__", None)
    return path if isinstance(path, str) else None


# The modules whose functions and classes ``_MainByValue`` leaves to cloudpickle.
_BY_VALUE = ("__main__", "builtins")


class _MainByValue(cloudpickle.Pickler):  # type: ignore[misc]  # (untyped)
    """Pickles the functions and classes ``__main__`` defines by value, the rest as
    plain ``pickle`` does. (The builtin types a function's pieces are rebuilt with,
    such as its code's, which plain ``pickle`` cannot name, are cloudpickle's too.)"""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and obj.__module__ in _BY_VALUE:
            return super().reducer_override(obj)
        return NotImplemented


def to_ranks(obj: object) -> bytes:
    """``obj`` pickled for the rank processes (see the module's rules).

    Raises:
        pickle.PicklingError, AttributeError, TypeError: it cannot be sent.
    """
    path = _main_file()
    if path == "" or (path is not None and os.path.isfile(path)):
        return pickle.dumps(obj)
    sent = io.BytesIO()
    _MainByValue(sent).dump(obj)
    return sent.getvalue()


def check_main_module() -> None:
    """The rank processes can rebuild the caller's main module.

    Raises:
        ConfigError: it was read from standard input.
    """
    path = _main_file()
    if path and not os.path.isfile(path):
        raise ConfigError(
            "ranks",
            f"the main module was read from {path} (python - or python < file), which the "
            "rank processes, started apart, cannot read again; save the script as a file "
            "and run that (python train.py), or train with ranks=1",
        )
