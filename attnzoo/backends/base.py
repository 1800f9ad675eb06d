"""The backend contract: say what you cannot run (with reasons), then run it.

Defined in :mod:`attnzoo.core.contract` (the registry validates plugins against it, below the backends in the
layers of docs/architecture.md); this is its public path for plugin authors (docs/plugins.md).
"""

from __future__ import annotations

from ..core.contract import EAGER_DTYPES, Backend, Grouped, HeldAttention, Mode, batch_mode, eager_dtype_reasons

__all__ = ["EAGER_DTYPES", "Backend", "Grouped", "HeldAttention", "Mode", "batch_mode", "eager_dtype_reasons"]
