"""attnzoo: attention variants declared as data, composed from transforms, held to a reference."""

from __future__ import annotations

__version__ = "0.1.0"

from . import nn  # ``attnzoo.nn`` works after ``import attnzoo``
from .backends.base import Backend, Mode
from .cache import KVCache
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
    MaskTransform,
    NormaliserTransform,
    ParamSpec,
    PointwiseSelection,
    RowMapTransform,
    RowScaleTransform,
    Slot,
    TokenInput,
    TokenRows,
    Transform,
    TransformOptions,
)
from .transforms.lowering import TritonLogits, TritonMask, TritonSelection
from .transforms.selective import memory_counts, memory_loss

__all__ = [
    "AccumulatorTransform", "AttnzooError", "Backend", "Context", "Dims", "Evictor", "EvictorOptions",
    "KVCache", "LogitsTransform", "MaskTransform", "Mode", "NormaliserTransform", "ParamSpec", "Plan", "PluginError",
    "PointwiseSelection", "Registry", "RowMapTransform", "RowScaleTransform", "Slot", "Spec", "SpecError",
    "TokenInput", "TokenRows", "Transform", "TransformOptions", "TritonLogits", "TritonMask", "TritonSelection",
    "UnsupportedError", "Variant", "__version__", "attention", "compile", "explain", "get_registry", "hookimpl",
    "load_spec", "memory_counts", "memory_loss", "new_registry", "nn",
]
