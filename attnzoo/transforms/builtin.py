"""Registers the built-in transforms through the same hook a third-party plugin uses."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .differential import Diff, DiffNorm
from .forgetting import ForgettingGate
from .logits import Alibi, ConstantTemperature, LearnableAlibi, Softcap, YarnScale
from .masks import Causal, Chunked, LocalGlobal, Prefix, SlidingWindow
from .norm import KeyNorm, QueryNorm
from .probability import Sigmoid, Softpick, StickBreaking
from .selective import SelectiveMask
from .sinks import AttentionSink
from .temperature import KeyTemperature, QueryTemperature, ValueTemperature

BUILTIN_TRANSFORMS = (
    QueryTemperature, KeyTemperature, ValueTemperature,
    QueryNorm, KeyNorm,
    Softcap, Alibi, LearnableAlibi, ConstantTemperature, YarnScale, ForgettingGate,
    SelectiveMask,
    AttentionSink,
    Sigmoid, Softpick, StickBreaking, Diff,
    DiffNorm,
    Causal, SlidingWindow, Chunked, LocalGlobal, Prefix,
)


@hookimpl
def register_transforms(register):
    for cls in BUILTIN_TRANSFORMS:
        register(cls)
