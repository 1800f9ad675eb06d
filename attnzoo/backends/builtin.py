"""Registers the built-in backends through the same hook a third-party plugin uses."""

from __future__ import annotations

from ..hookspecs import hookimpl
from .blocked import BlockedBackend
from .flex import FlexBackend
from .reference import ReferenceBackend
from .triton import TritonBackend
from .xformers_backend import XformersBackend


@hookimpl
def register_backends(register):
    register(ReferenceBackend())
    register(BlockedBackend())
    register(FlexBackend())
    register(TritonBackend())
    register(XformersBackend())
