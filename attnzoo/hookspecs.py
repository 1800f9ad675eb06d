"""The hooks a plugin may implement. Every hook receives a ``register`` callback and calls it once per item.

Plugins import :data:`attnzoo.hookimpl` and never pluggy itself. Hooks are called once, when the registry is
first built; the callback validates each item and refuses duplicates with a :class:`attnzoo.PluginError`.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("attnzoo")
hookimpl = pluggy.HookimplMarker("attnzoo")


@hookspec
def register_transforms(register):
    """Register transform classes: call ``register(cls)`` with a subclass of ``attnzoo.Transform``."""


@hookspec
def register_evictors(register):
    """Register KV-cache evictor classes: call ``register(cls)`` with a subclass of ``attnzoo.Evictor``."""


@hookspec
def register_backends(register):
    """Register backends: call ``register(backend)`` with an instance of ``attnzoo.Backend``."""


@hookspec
def register_specs(register):
    """Register spec files: call ``register(path)`` with the path of a YAML, TOML or JSON spec file."""
