"""Where a plugin's exception was raised: the innermost frame of plugin code, for the one-line failure message.

A frame is *core* when its file lies in attnzoo's package, in one of the packages attnzoo runs on (torch, numpy,
pydantic, pluggy, pyyaml, safetensors, triton, ...) or in Python's standard library (but not its site-packages,
where a plugin may be installed); every other frame is the plugin's (a plugin package, a test file, a script).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import site
import sysconfig
import traceback

#: the packages attnzoo runs on: frames in them are never a plugin's
CORE_PACKAGES = ("attnzoo", "torch", "numpy", "pydantic", "pydantic_core", "pluggy", "yaml", "safetensors", "rich",
                 "filelock", "platformdirs", "triton", "typing_extensions", "functorch", "sympy")


def _real(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))


@functools.cache
def _roots() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(core package folders or files, standard library folders, site-packages folders), resolved."""
    packages = []
    for name in CORE_PACKAGES:
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            continue
        if found.submodule_search_locations:
            packages += [_real(p) for p in found.submodule_search_locations]
        elif found.origin:
            packages.append(_real(found.origin))
    paths = sysconfig.get_paths()
    stdlib = {_real(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)}
    sites = {_real(paths[k]) for k in ("purelib", "platlib") if paths.get(k)}
    try:
        sites.update(_real(p) for p in site.getsitepackages())
    except AttributeError:  # some virtual environments' site module lacks it
        pass
    return tuple(packages), tuple(stdlib), tuple(sites)


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def is_core(filename: str) -> bool:
    """Whether a frame's file is attnzoo's, a core dependency's or the standard library's (``<frozen ...>``,
    ``<string>`` and other pseudo-files count as core: no plugin file to point at)."""
    if filename.startswith("<"):
        return True
    path = _real(filename)
    packages, stdlib, sites = _roots()
    return _under(path, packages) or (_under(path, stdlib) and not _under(path, sites))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ if exc.__cause__ is not None else (None if exc.__suppress_context__ else exc.__context__)
    return seen


def _show(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    try:
        relative = os.path.relpath(path)
        if not relative.startswith(os.pardir):
            path = relative
    except ValueError:  # another drive (Windows)
        pass
    return f"{path}:{frame.lineno} in {frame.name}"


def plugin_frame(exc: BaseException, innermost_only: bool = False) -> str | None:
    """``path:line in function`` of the innermost plugin frame of ``exc``'s traceback (of the exception it was
    raised from, first, when it has one), or None when every frame is core. ``innermost_only``: only when
    ``exc`` itself was raised in plugin code (its innermost frame is the plugin's; an AssertionError a check raises
    is the check's failure, not a crash)."""
    if innermost_only:
        frames = traceback.extract_tb(exc.__traceback__)[-1:]
        return _show(frames[0]) if frames and not is_core(frames[0].filename) else None
    for link in reversed(_chain(exc)):
        for frame in reversed(traceback.extract_tb(link.__traceback__)):
            if not is_core(frame.filename):
                return _show(frame)
    return None
