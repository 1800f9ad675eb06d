"""The triton backend: kernels generated from specs (``codegen.py`` + ``template.py``), built and cached on disk
(``build.py``), run by ``backend.py``."""

from .backend import TritonBackend

__all__ = ["TritonBackend"]
