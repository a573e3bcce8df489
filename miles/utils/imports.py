"""`module.path:function` flags (--custom-rm-path, --dynamic-sampling-filter-path): the function, or
one `error:` line naming the flag and what is wrong."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from miles.errors import UsageError


def load_function(path: str, flag: str) -> Callable:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise UsageError(f"{flag} must look like module.path:function (got {path!r})")
    # `python -m` and console scripts differ on whether cwd is importable; users expect it is.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(
            f"{flag} {path}: cannot import module {module_name!r} ({e}); "
            "run from the directory that contains it or add it to PYTHONPATH"
        ) from e
    except SyntaxError as e:
        raise UsageError(f"{flag} {path}: {e.filename}:{e.lineno}: {e.msg}; fix the module") from None
    except Exception as e:  # the module's own top-level code raised
        raise UsageError(f"{flag} {path}: importing {module_name!r} raised {type(e).__name__}: {e}; fix the module") \
            from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"{flag} {path}: module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise UsageError(f"{flag} {path}: {attr!r} is not callable; name a function")
    return fn
