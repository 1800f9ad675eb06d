"""Mask transforms: which (query, key) pairs may attend. All compare absolute positions, so they hold in the
batch form, in chunks and in decoding alike."""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Context, MaskTransform, Slot, TransformOptions
from .lowering import TritonMask


class Causal(MaskTransform):
    """A query attends to keys at its own or earlier positions (the same as ``attention: {causal: true}``)."""

    kind = "causal"
    slot = Slot.MASK
    summary = "key position <= query position"

    def allowed(self, ctx: Context):
        return ctx.kpos <= ctx.qpos

    def triton(self):
        return TritonMask("kp <= qp")


class SlidingWindowOptions(TransformOptions):
    window: int = Field(ge=1, description="how many most recent tokens (the query's own included) are visible")


class SlidingWindow(MaskTransform):
    """Causal local attention: query i sees keys j with i - window < j <= i (the selective-attention paper's
    "local" baseline)."""

    kind = "sliding_window"
    slot = Slot.MASK
    Options = SlidingWindowOptions
    summary = "causal, and at most `window` tokens back"

    def allowed(self, ctx: Context):
        gap = ctx.qpos - ctx.kpos
        return (gap >= 0) & (gap < self.options.window)

    def triton(self):
        return TritonMask(f"(qp - kp >= 0) & (qp - kp < {self.options.window})")

    def earliest_key(self, query_position):
        return query_position - self.options.window + 1


class ChunkedOptions(TransformOptions):
    chunk: int = Field(ge=1, description="tokens per chunk: positions 1..chunk form the first chunk, "
                                         "chunk+1..2*chunk the second, and so on; a query sees only its own chunk")


class Chunked(MaskTransform):
    """Chunked local attention (Llama 4's ``attention_chunk_size``, vLLM's chunked local attention): the positions
    are cut into consecutive chunks of ``chunk`` tokens, and query i sees keys j with j <= i in its own chunk,
    ``(j - 1) // chunk == (i - 1) // chunk`` (positions are 1-based: transformers' 0-based ``kv_idx // chunk ==
    q_idx // chunk``). Unlike a sliding window, the first query of a chunk sees itself alone."""

    kind = "chunked"
    slot = Slot.MASK
    Options = ChunkedOptions
    summary = "causal, within the query's chunk of `chunk` tokens"

    def allowed(self, ctx: Context):
        c = self.options.chunk
        same = torch.div(ctx.qpos - 1, c, rounding_mode="floor") == torch.div(ctx.kpos - 1, c, rounding_mode="floor")
        return (ctx.kpos <= ctx.qpos) & same

    def triton(self):
        # Triton's integer // truncates toward zero (C semantics); positions are >= 1 (padding and out-of-range
        # tiles take real positions), so both sides are >= 0 and truncation is floor division.
        c = self.options.chunk
        return TritonMask(f"(kp <= qp) & ((kp - 1) // {c} == (qp - 1) // {c})")

    def earliest_key(self, query_position):
        # the first position of the query's chunk: non-decreasing in query_position, so a bound for later queries
        c = self.options.chunk
        return (query_position - 1) // c * c + 1


class LocalGlobalOptions(TransformOptions):
    window: int = Field(ge=1)
    global_heads: int = Field(ge=0, description="the first `global_heads` heads attend to the whole causal past")


class LocalGlobal(MaskTransform):
    """Local-global baseline within one layer: heads ``< global_heads`` are global (causal), the others local
    (sliding window). The paper alternates local and global *layers*; a model gets that by giving its layers
    specs with ``global_heads: 0`` or all heads global. The per-head split is attnzoo's choice ([open])."""

    kind = "local_global"
    slot = Slot.MASK
    Options = LocalGlobalOptions
    summary = "first `global_heads` heads causal, the rest a sliding window"

    def allowed(self, ctx: Context):
        gap = ctx.qpos - ctx.kpos
        local = gap < self.options.window
        return (gap >= 0) & (local | (ctx.heads < self.options.global_heads))

    def triton(self):
        o = self.options
        return TritonMask(f"(qp - kp >= 0) & ((qp - kp < {o.window}) | (head < {o.global_heads}))")

    def earliest_key(self, query_position):
        return None if self.options.global_heads > 0 else query_position - self.options.window + 1


class PrefixOptions(TransformOptions):
    length: int = Field(ge=1, description="tokens 1..length attend to each other both ways")


class Prefix(MaskTransform):
    """Prefix-LM: causal, except that the first ``length`` positions see each other bidirectionally.
    Use with ``attention: {causal: false}`` (the spec-level causal mask would otherwise cancel the prefix)."""

    kind = "prefix"
    slot = Slot.MASK
    Options = PrefixOptions
    summary = "bidirectional within the first `length` tokens, causal after"

    def allowed(self, ctx: Context):
        n = self.options.length
        return (ctx.kpos <= ctx.qpos) | ((ctx.kpos <= n) & (ctx.qpos <= n))

    def triton(self):
        n = self.options.length
        return TritonMask(f"(kp <= qp) | ((kp <= {n}) & (qp <= {n}))")

    def check_spec(self, spec):
        if spec.attention.causal:
            return "prefix needs attention.causal: false (the causal mask would hide the prefix's future)"
        return None
