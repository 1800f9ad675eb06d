"""The decode-time KV cache lives in :mod:`attnzoo.decode` (``attnzoo.decode.storage``); this module keeps the old
import path working for ``KVCache``, ``ACCUMULATED_STATE``, ``accumulator_dtype`` and ``new_token_positions``."""

from __future__ import annotations

from .decode.storage import ACCUMULATED_STATE, KVCache, accumulator_dtype, new_token_positions

__all__ = ["ACCUMULATED_STATE", "KVCache", "accumulator_dtype", "new_token_positions"]
