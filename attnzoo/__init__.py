"""attnzoo: attention variants declared as data, composed from transforms, held to a reference.

The public names below are imported on first use (PEP 562), so ``import attnzoo`` — and the pytest plugin that
installing attnzoo registers — costs nothing until a name is touched; ``import attnzoo as zt; zt.compile(...)``
works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> (module, attribute); an attribute of None is the module itself
_LAZY: dict[str, tuple[str, str | None]] = {
    "nn": (".nn", None),
    "Backend": (".backends.base", "Backend"),
    "Mode": (".backends.base", "Mode"),
    "KVCache": (".decode.storage", "KVCache"),
    "Variant": (".dispatch", "Variant"),
    "attention": (".dispatch", "attention"),
    "compile": (".dispatch", "compile"),
    "explain": (".dispatch", "explain"),
    "AttnzooError": (".errors", "AttnzooError"),
    "PluginError": (".errors", "PluginError"),
    "SpecError": (".errors", "SpecError"),
    "UnsupportedError": (".errors", "UnsupportedError"),
    "Evictor": (".evictors.base", "Evictor"),
    "EvictorOptions": (".evictors.base", "EvictorOptions"),
    "hookimpl": (".hookspecs", "hookimpl"),
    "Plan": (".plan", "Plan"),
    "Registry": (".registry", "Registry"),
    "get_registry": (".registry", "get_registry"),
    "new_registry": (".registry", "new_registry"),
    "Spec": (".spec", "SpecBase"),
    "load_spec": (".spec", "load_spec"),
    **{name: (".transforms.base", name) for name in (
        "AccumulatorTransform", "Context", "Dims", "LogitsTransform", "MapStep", "MaskTransform",
        "NormaliserTransform", "ParamSpec", "PointwiseSelection", "ProbabilityTransform", "RowMapTransform",
        "RowScaleTransform", "Slot", "TokenInput", "TokenRows", "Transform", "TransformOptions")},
    "TritonLogits": (".transforms.lowering", "TritonLogits"),
    "TritonMask": (".transforms.lowering", "TritonMask"),
    "TritonProbability": (".transforms.lowering", "TritonProbability"),
    "TritonSelection": (".transforms.lowering", "TritonSelection"),
    "memory_counts": (".transforms.selective", "memory_counts"),
    "memory_loss": (".transforms.selective", "memory_loss"),
}

__all__ = [
    "AccumulatorTransform", "AttnzooError", "Backend", "Context", "Dims", "Evictor", "EvictorOptions",
    "KVCache", "LogitsTransform", "MapStep", "MaskTransform", "Mode", "NormaliserTransform", "ParamSpec", "Plan",
    "PluginError", "PointwiseSelection", "ProbabilityTransform", "Registry", "RowMapTransform", "RowScaleTransform",
    "Slot", "Spec", "SpecError", "TokenInput", "TokenRows", "Transform", "TransformOptions", "TritonLogits",
    "TritonMask",
    "TritonProbability", "TritonSelection", "UnsupportedError", "Variant", "__version__", "attention", "compile",
    "explain", "get_registry", "hookimpl", "load_spec", "memory_counts", "memory_loss", "new_registry", "nn",
]  # every name of _LAZY, and __version__ (tests/test_import_cost.py holds the two together)


def __getattr__(name: str):
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'attnzoo' has no attribute '{name}'") from None
    value = importlib.import_module(module, __name__)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


if TYPE_CHECKING:  # what static tools see; at run time the names above are imported on first use
    from . import nn
    from .backends.base import Backend, Mode
    from .decode.storage import KVCache
    from .dispatch import Variant, attention, compile, explain
    from .errors import AttnzooError, PluginError, SpecError, UnsupportedError
    from .evictors.base import Evictor, EvictorOptions
    from .hookspecs import hookimpl
    from .plan import Plan
    from .registry import Registry, get_registry, new_registry
    from .spec import SpecBase as Spec
    from .spec import load_spec
    from .transforms.base import (
        AccumulatorTransform,
        Context,
        Dims,
        LogitsTransform,
        MapStep,
        MaskTransform,
        NormaliserTransform,
        ParamSpec,
        PointwiseSelection,
        ProbabilityTransform,
        RowMapTransform,
        RowScaleTransform,
        Slot,
        TokenInput,
        TokenRows,
        Transform,
        TransformOptions,
    )
    from .transforms.lowering import TritonLogits, TritonMask, TritonProbability, TritonSelection
    from .transforms.selective import memory_counts, memory_loss
