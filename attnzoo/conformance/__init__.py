"""The conformance suite: test vectors and checks that every backend and plugin is held to.

Run it with ``attnzoo conformance`` or, in a plugin's own test suite, ``pytest --attnzoo-conformance`` (the
pytest plugin ships with attnzoo). See docs/conformance.md.
"""

from .checks import Target, Unsupported
from .runner import Case, Result, build_cases, matrix, run_suite, to_json, to_markdown
from .tolerance import FLOOR, check_close

__all__ = ["FLOOR", "Case", "Result", "Target", "Unsupported", "build_cases", "check_close", "matrix", "run_suite",
           "to_json", "to_markdown"]
