"""The conformance suite: test vectors and checks that every backend and plugin is held to.

Run it with ``attnzoo conformance`` or, in a plugin's own test suite, ``pytest --attnzoo-conformance`` (the
pytest plugin ships with attnzoo). See docs/conformance.md. The names below are imported on first use, so the
pytest plugin (``attnzoo.conformance.pytest_plugin``) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {"Target": ".checks", "Unsupported": ".checks", "Case": ".runner", "Result": ".runner",
         "build_cases": ".runner", "matrix": ".runner", "run_suite": ".runner", "to_json": ".runner",
         "to_markdown": ".runner", "FLOOR": ".tolerance", "check_close": ".tolerance"}

__all__ = ["FLOOR", "Case", "Result", "Target", "Unsupported", "build_cases", "check_close", "matrix", "run_suite",
           "to_json", "to_markdown"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'attnzoo.conformance' has no attribute '{name}'")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .checks import Target, Unsupported
    from .runner import Case, Result, build_cases, matrix, run_suite, to_json, to_markdown
    from .tolerance import FLOOR, check_close
