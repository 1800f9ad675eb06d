"""attnzoo in vLLM (docs/vllm.md): a plugin (entry point group ``vllm.general_plugins``) that serves a checkpoint
saved after ``zt.apply`` with its attnzoo spec, over vLLM's paged KV cache, or, for a spec that evicts, over one page
of budget + 1 tokens per request and layer (:mod:`.ring`).

:func:`register` (run by vLLM in every process it starts) puts :class:`~.backend.AttnzooCPUBackend` in the place
of vLLM's CPU attention backend and has vLLM's weight loading leave attnzoo's own tensors to it. A checkpoint
without an attnzoo record (``config.attnzoo``) runs vLLM's own CPU attention unchanged: the backend defers to it,
layer by layer; an ``attnzoo`` key that holds a malformed record is refused at engine start, read as
``zt.from_pretrained`` reads it (:func:`~attnzoo.integrations.transformers.records.check_record`). What vLLM cannot
run exactly (per-token features and inputs, an accumulator without a cache section, ...) is declined at engine start
with one line naming the spec, the transform and the reason (:mod:`.start`, :func:`~.spec.declined`).
"""

from __future__ import annotations

#: the vLLM release this integration was written and tested against (``pip install 'attnzoo[vllm]'``)
TESTED_VLLM = "0.32.0"


def register() -> None:
    """vLLM's plugin hook: register the attention backend and the weight filter. Idempotent."""
    from .install import install

    install()


def __getattr__(name):
    if name == "ServeDeclined":
        from .start import ServeDeclined

        return ServeDeclined
    raise AttributeError(name)


__all__ = ["TESTED_VLLM", "ServeDeclined", "register"]
