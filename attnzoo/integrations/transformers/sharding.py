"""``shard_sequence``: an applied model whose attention layers run context-parallel (docs/distributed.md).

Everything in a decoder but attention acts on each token alone (embeddings, norms, MLPs, RoPE from the given
``position_ids``), so a model runs on a shard of the sequence once its attention does: each layer's core becomes an
:class:`attnzoo.distributed.ShardedAttention` sharing the core's parameters (the same objects, under the same
``state_dict`` names). Each rank then calls the model on its tokens with their true ``position_ids`` and, for the
loss, labels shifted along the whole sequence (``shift_labels``), not within the shard."""

from __future__ import annotations

import torch

from ...distributed import Layout, ShardedAttention
from .base import CORE_NAME, IntegrationError, applied_modules

#: where a sharded layer keeps the core it replaced (outside ``_modules``: not a second copy in ``state_dict``)
_UNSHARDED = "_attnzoo_unsharded"


def shard_sequence(model, group=None, **options):
    """Make every attention layer of an applied ``model`` (:func:`apply`) context-parallel over ``group`` (None:
    the default process group), in place; ``options`` as for :class:`~attnzoo.distributed.ContextParallel`
    (``balanced``, ``method``, ``block_size``, ``gather_limit``). Parameters are shared, not copied: an optimizer
    built before still holds them. Parameter gradients are each rank's share: sum them over the ranks
    (:func:`attnzoo.distributed.sum_gradients`). Decoding is not sharded (:func:`unshard_sequence` first).
    Returns the model."""
    for module in applied_modules(model):
        core = getattr(module, CORE_NAME)
        if isinstance(core, ShardedAttention):
            core = module.__dict__[_UNSHARDED]
        sharded = ShardedAttention.from_attention(core, group, **options)
        sharded.hf_call = core.hf_call
        module.__dict__[_UNSHARDED] = core
        setattr(module, CORE_NAME, sharded)
    return model


def unshard_sequence(model):
    """Undo :func:`shard_sequence` (the same parameters, back in single-process cores). Returns the model."""
    for module in applied_modules(model):
        core = module.__dict__.pop(_UNSHARDED, None)
        if core is not None:
            setattr(module, CORE_NAME, core)
    return model


def is_sharded(model) -> bool:
    return any(isinstance(getattr(m, CORE_NAME), ShardedAttention) for m in applied_modules(model))


def sequence_shard(layout: Layout, rank: int, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """The keyword arguments of ``rank``'s model call for a whole batch ``input_ids`` (B, N) under ``layout``:
    its ``input_ids``, its true 0-based ``position_ids`` and, with ``labels`` (B, N), its ``shift_labels`` (the
    next token's label, shifted along the whole sequence; the last token's is ``ignore_index``)."""
    if input_ids.dim() != 2 or input_ids.shape[1] != layout.seq_len:
        raise IntegrationError(f"sequence_shard: input_ids of shape {tuple(input_ids.shape)} are not (B, "
                               f"{layout.seq_len}) for {layout}")
    b = input_ids.shape[0]
    out = {"input_ids": layout.shard(input_ids, rank, dim=-1),
           "position_ids": layout.positions(rank, b, first=0, device=input_ids.device)}
    if labels is not None:
        if labels.shape != input_ids.shape:
            raise IntegrationError(f"sequence_shard: labels of shape {tuple(labels.shape)} differ from input_ids' "
                                   f"{tuple(input_ids.shape)}")
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
        out["shift_labels"] = layout.shard(shifted, rank, dim=-1)
    return out
