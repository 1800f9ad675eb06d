"""The plugin registry: built-in features and third-party packages register through the same pluggy hooks.

Nothing loads at import time. :func:`get_registry` builds the default registry on first use and caches it;
:func:`new_registry` builds an isolated one (for tests, or to load a chosen set of plugins). Third-party plugins
come from the entry-point group ``attnzoo``; the environment variable ``ATTNZOO_PLUGINS`` restricts which load
(a comma-separated list of entry-point or distribution names; empty or ``none`` loads no third-party plugin).
A plugin that fails to import, misspells a hook or registers something invalid is reported by name (a warning,
and in ``attnzoo list``) and skipped; the others still load.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
import types
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pluggy

from . import hookspecs
from .errors import PluginError

ENTRY_POINT_GROUP = "attnzoo"
PLUGINS_ENV = "ATTNZOO_PLUGINS"
DEFAULT_PLUGINS = (
    "attnzoo.transforms.builtin",
    "attnzoo.evictors.builtin",
    "attnzoo.backends.builtin",
    "attnzoo.builtin_specs",
)
CATEGORIES = ("transforms", "evictors", "backends", "specs")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class PluginWarning(UserWarning):
    """A plugin could not be loaded or registered something invalid; the rest of the registry still works."""


@dataclass
class PluginInfo:
    """What ``attnzoo list`` shows for one plugin."""

    name: str
    package: str
    version: str
    builtin: bool
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class Registry:
    """Everything the loaded plugins registered: transform and evictor classes, backends, specs."""

    def __init__(self) -> None:
        self.transforms: dict[str, type] = {}
        self.evictors: dict[str, type] = {}
        self.backends: dict[str, Any] = {}
        self.specs: dict[str, Any] = {}
        self.plugins: dict[str, PluginInfo] = {}
        self.origin: dict[tuple[str, str], str] = {}
        self._spec_model: type | None = None

    # -- lookups ---------------------------------------------------------------------------------------------
    def spec_model(self) -> type:
        """The pydantic model of a spec file, with ``transforms`` a union over the registered transform kinds."""
        if self._spec_model is None:
            from .spec_data import build_spec_model

            self._spec_model = build_spec_model(self.transforms, self.evictors)
        return self._spec_model

    def errors(self) -> list[str]:
        return [f"plugin '{p.name}' ({p.package}): {e}" for p in self.plugins.values() for e in p.errors]

    def check_pending(self) -> None:
        """Raise :class:`PluginError` if any plugin failed (strict mode for CI and plugin authors)."""
        errs = self.errors()
        if errs:
            raise PluginError("; ".join(errs))

    # -- registration callbacks -------------------------------------------------------------------------------
    def _validate(self, category: str, item: Any, plugin: str, staged: dict[str, Any]) -> str:
        if category == "transforms":
            from .transforms.base import Transform

            name = _check_class(item, Transform, "transform")
        elif category == "evictors":
            from .evictors.base import Evictor

            name = _check_class(item, Evictor, "evictor")
        elif category == "backends":
            from .core.contract import Backend

            if not isinstance(item, Backend):
                raise PluginError(f"register_backends expects a Backend instance, got {item!r}")
            name = _check_name(getattr(item, "name", None), "backend")
            problem = _backend_problem(item)
            if problem:
                raise PluginError(f"backend '{name}': {problem}")
        else:
            if not isinstance(item, (str, Path)):
                raise PluginError(f"register_specs expects the path of a spec file, got {item!r}")
            name = str(item)
        table = getattr(self, category)
        if name in table or name in staged:
            owner = self.origin.get((category, name), plugin)
            raise PluginError(f"{category[:-1]} '{name}' is already registered (by '{owner}')")
        return name


def _backend_problem(backend: Any) -> str | None:
    """A break of the backend contract visible without running it (docs/plugins.md), or None."""
    from .core.contract import Mode

    modes = getattr(backend, "modes", None)
    if not isinstance(modes, (set, frozenset)) or not modes or not all(isinstance(m, Mode) for m in modes):
        return f"modes must be a non-empty frozenset of attnzoo.backends.base.Mode, got {modes!r}"
    return None


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise PluginError(f"{what} name {name!r} must match {_NAME.pattern}")
    return name


def _check_class(cls: Any, base: type, what: str) -> str:
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PluginError(f"register_{what}s expects a subclass of {base.__name__}, got {cls!r}")
    name = _check_name(getattr(cls, "kind", None), what)
    problem = cls.contract_problem()
    if problem:
        raise PluginError(f"{what} '{name}': {problem}")
    return name


def _allowed_plugins() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None:
        return None
    names = {n.strip() for n in raw.split(",") if n.strip()}
    return set() if names == {"none"} else names


def _entry_points() -> Iterable[metadata.EntryPoint]:
    return metadata.entry_points(group=ENTRY_POINT_GROUP)


def new_registry(
    *,
    entry_points: bool = True,
    extra_plugins: Iterable[tuple[str, object]] = (),
) -> Registry:
    """Build an isolated registry: built-ins, then entry-point plugins (if ``entry_points``), then
    ``extra_plugins`` given as ``(name, module_or_object)`` pairs (handy in tests)."""
    import attnzoo

    reg = Registry()
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    order: list[str] = []

    def add(name: str, obj: object, info: PluginInfo) -> None:
        reg.plugins[name] = info
        unknown = _unknown_hooks(obj)
        if unknown:  # report each misspelled hook, and register the plugin's other hooks
            from .spec_data import did_you_mean

            for hook in unknown:
                info.errors.append(f"cannot register: unknown hook '{hook}'{did_you_mean(hook, _HOOK_NAMES)} "
                                   f"(hooks: {', '.join(_HOOK_NAMES)}); ignored, its other hooks are registered")
            obj = types.SimpleNamespace(**{attr: getattr(obj, attr) for attr in dir(obj)
                                           if _is_hookimpl(obj, attr) and attr not in unknown})
        try:
            pm.register(obj, name=name)
            pm.check_pending()
        except Exception as exc:  # a non-hook object, a name clash
            if pm.is_registered(obj):
                pm.unregister(obj)
            info.errors.append(f"cannot register: {_one_line(exc)}")
            return
        info.hooks = sorted(h.name for h in pm.get_hookcallers(obj) or [])
        order.append(name)

    for module_name in DEFAULT_PLUGINS:
        add(module_name, importlib.import_module(module_name),
            PluginInfo(module_name, "attnzoo", attnzoo.__version__, builtin=True))

    if entry_points:
        allowed = _allowed_plugins()
        for ep in sorted(_entry_points(), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            package = dist.name if dist is not None else "?"
            version = dist.version if dist is not None else "?"
            if allowed is not None and ep.name not in allowed and package not in allowed:
                continue
            info = PluginInfo(ep.name, package, version, builtin=False)
            try:
                obj = ep.load()
            except Exception as exc:  # report by name, keep going
                info.errors.append(f"failed to load: {_one_line(exc)}")
                reg.plugins[ep.name] = info
                continue
            add(ep.name, obj, info)

    for name, obj in extra_plugins:
        add(name, obj, PluginInfo(name, getattr(obj, "__name__", name), "?", builtin=False))

    for category in CATEGORIES:
        hook = getattr(pm.hook, f"register_{category}")
        impls = {impl.plugin_name: impl for impl in hook.get_hookimpls()}
        for plugin_name in order:
            impl = impls.get(plugin_name)
            if impl is not None:
                _collect(reg, category, plugin_name, impl.function)

    for info in reg.plugins.values():
        for err in info.errors:
            warnings.warn(f"attnzoo: plugin '{info.name}' ({info.package}): {err}", PluginWarning, stacklevel=2)
    return reg


def _collect(reg: Registry, category: str, plugin: str, function: Callable) -> None:
    staged: dict[str, Any] = {}

    def register(item: Any) -> None:
        name = reg._validate(category, item, plugin, staged)  # noqa: SLF001 -- the Registry's own module
        staged[name] = item

    info = reg.plugins[plugin]
    try:
        function(register=register)
    except Exception as exc:
        info.errors.append(f"register_{category} failed: {_one_line(exc)}")
        return
    if category == "specs":
        from .errors import SpecError
        from .spec_data import load_spec

        for path in staged.values():
            try:
                spec = load_spec(Path(path), registry=reg)
            except SpecError as exc:
                info.errors.append(str(exc))
                continue
            if spec.name in reg.specs:
                owner = reg.origin[("specs", spec.name)]
                info.errors.append(f"spec '{spec.name}' is already registered (by '{owner}')")
                continue
            reg.specs[spec.name] = spec
            reg.origin[("specs", spec.name)] = plugin
            info.registered.setdefault(category, []).append(spec.name)
        return
    getattr(reg, category).update(staged)
    for name in staged:
        reg.origin[(category, name)] = plugin
    info.registered.setdefault(category, []).extend(staged)
    reg._spec_model = None  # noqa: SLF001 -- the Registry's own module: the spec model is rebuilt on next use


_HOOK_NAMES = sorted(n for n in dir(hookspecs) if n.startswith("register_"))


def _is_hookimpl(obj: object, attr: str) -> bool:
    try:
        return callable(getattr(obj, attr, None)) and hasattr(getattr(obj, attr), f"{ENTRY_POINT_GROUP}_impl")
    except Exception:  # noqa: BLE001 - a property that raises is no hook
        return False


def _unknown_hooks(obj: object) -> list[str]:
    """The names ``obj`` marks as hook implementations that no hook spec declares (misspellings)."""
    return sorted(a for a in dir(obj) if _is_hookimpl(obj, a) and a not in _HOOK_NAMES)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_default: Registry | None = None
# Building loads every plugin once: concurrent first callers wait for the one build rather than each making a
# registry of their own (which would load the plugins again and split caches keyed by the registry). Reentrant,
# so a plugin hook that asks for the registry while it is being built gets an error instead of a hang.
_default_lock = threading.RLock()
_building = False


def get_registry() -> Registry:
    """The process-wide registry, built on first use (lazily, once, even when threads ask at the same time)."""
    found = _default
    if found is not None:  # the common case takes no lock
        return found
    with _default_lock:
        return _build_default()


def _build_default() -> Registry:
    global _default, _building
    if _default is None:
        if _building:
            raise PluginError("get_registry() was called while the registry is being built (from a plugin hook?)")
        _building = True
        try:
            _default = new_registry()
        finally:
            _building = False
    return _default


def reset_registry() -> None:
    """Forget the cached default registry (the next :func:`get_registry` rebuilds it)."""
    global _default
    with _default_lock:
        _default = None
