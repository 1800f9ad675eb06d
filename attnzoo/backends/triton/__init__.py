"""The triton backend: kernels generated from specs (``codegen.py`` + ``template.py``), run by ``backend.py``."""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
