"""Tensor parallelism (docs/vllm.md, "Tensor parallel"): vLLM gives each rank of ``tensor_parallel_size`` its own
query heads (``num_heads // tp``, rank ``r`` holds heads ``r * H / tp`` ...) and key/value heads (``H_kv / tp`` of
them, or, when ``tp > H_kv``, one head replicated over ``tp / H_kv`` ranks), and its own KV cache (an evicting spec's
ring pages hold the rank's key/value heads). The rank's attnzoo core is built at the rank's heads
(``layer.load_layer``), with every transform parameter that has a head axis (``H`` or ``H_kv`` in its
:class:`~attnzoo.transforms.base.ParamSpec` shape: SSA's per-head token weights, a per-head QK-norm gain, learnable
ALiBi slopes, ...) sliced to the rank's heads (:func:`slice_parameters`).

What cannot be split exactly is refused at engine start in one line (:func:`split_refusal`): head counts that do not
divide, a parameter with two head axes (it mixes heads), a transform that reads a head's index among all heads
(:data:`HEAD_INDEXED`), and any spec whose rank cores, on a probe, do not give exactly the rank's heads of the whole
core's output (prefill, eviction and decode steps, in float64). Needs no vLLM import."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..transformers.base import IntegrationError

#: built-in transforms whose behaviour reads a query head's index among all the layer's heads (or their number)
#: beyond their parameters: a rank's core sees its own heads from 0, so it would compute another head's attention
HEAD_INDEXED = {
    "alibi": "its slopes are computed from each head's index among all heads (alibi_learnable's are parameters, "
             "and split)",
    "local_global": "heads below global_heads are global: a rank's head 0 is not the layer's",
    "selective_mask": "one selector head's selection is applied to every head, and the selector lives on one rank",
}
#: the probe's prompt, its decode steps, and the largest budget it evicts to (a larger recorded budget: this one)
PROBE_TOKENS, PROBE_STEPS, PROBE_BUDGET = 24, 12, 8
HEAD_SYMBOLS = ("H", "H_kv")


@dataclass(frozen=True)
class RankHeads:
    """The heads of tensor-parallel rank ``rank`` of ``size``: its query heads and key/value heads (ranges of the
    layer's), and the layer's totals."""

    rank: int
    size: int
    heads: range
    kv_heads: range
    num_heads: int
    num_kv_heads: int


def rank_heads(num_heads: int, num_kv_heads: int, size: int, rank: int) -> RankHeads:
    """Rank ``rank``'s heads as vLLM's QKV projection gives them (``QKVParallelLinear``): ``num_heads / size`` query
    heads each, ``num_kv_heads / size`` key/value heads each, or one of them replicated over ``size / num_kv_heads``
    ranks when ``size > num_kv_heads``. Refused (one line) where the heads do not divide."""
    if size < 1 or not 0 <= rank < size:
        raise IntegrationError(f"tensor parallel rank {rank} of {size}")
    if num_heads % size:
        raise IntegrationError(f"{num_heads} query heads do not split over tensor_parallel_size {size} (vLLM gives "
                               f"each rank num_heads // tp of them)")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise IntegrationError(f"{num_kv_heads} key/value heads do not split over tensor_parallel_size {size}")
        per = num_kv_heads // size
        kv = range(rank * per, (rank + 1) * per)
    else:
        if size % num_kv_heads:
            raise IntegrationError(f"{num_kv_heads} key/value heads cannot be replicated evenly over "
                                   f"tensor_parallel_size {size}")
        head = rank // (size // num_kv_heads)
        kv = range(head, head + 1)
    per = num_heads // size
    return RankHeads(rank, size, range(rank * per, (rank + 1) * per), kv, num_heads, num_kv_heads)


def head_axis(key: str, shape: tuple) -> tuple[int, str] | None:
    """(axis, ``"H"`` or ``"H_kv"``) of the parameter ``key`` declared with ``shape`` (:class:`ParamSpec` symbols),
    or None without a head axis; refused (one line) with more than one: the parameter mixes heads."""
    axes = [(i, s) for i, s in enumerate(shape) if s in HEAD_SYMBOLS]
    if len(axes) > 1:
        raise IntegrationError(f"parameter '{key}' has shape {tuple(shape)}: it mixes heads, which cannot be split "
                               f"over tensor-parallel ranks")
    return axes[0] if axes else None


def slice_parameters(found: dict[str, torch.Tensor], plan, heads: RankHeads) -> dict[str, torch.Tensor]:
    """The rank's share of a layer's attnzoo parameters ``found`` (keyed as the core's ``state_dict()``:
    ``transform_params.<kind>__<name>``, as :func:`.spec.layer_parameters` reads them from the checkpoint): each
    parameter ``plan`` declares with a head axis narrowed to ``heads``' query or key/value heads, the others whole.
    A key ``plan`` does not declare is left as it is (the caller's shape check names it)."""
    declared = {f"transform_params.{key.replace('.', '__')}": p.shape for key, (_, p) in plan.param_specs().items()}
    out = {}
    for key, value in found.items():
        shape = declared.get(key)
        axis = head_axis(key.split(".", 1)[1].replace("__", "."), shape) if shape is not None else None
        if axis is None:
            out[key] = value
            continue
        dim, symbol = axis
        wanted, total = (heads.heads, heads.num_heads) if symbol == "H" else (heads.kv_heads, heads.num_kv_heads)
        if value.shape[dim] != total:
            raise IntegrationError(f"parameter '{key}' has {value.shape[dim]} heads on axis {dim} in the checkpoint, "
                                   f"the layer {total}")
        out[key] = value.narrow(dim, wanted.start, len(wanted))
    return out


def split_refusal(spec, num_heads: int, num_kv_heads: int, head_dim: int, size: int,
                  budget: int | None = None) -> str | None:
    """Why ``spec`` cannot be split over ``size`` tensor-parallel ranks exactly (one line), or None. ``budget``: an
    evicting spec's (the probe evicts to at most :data:`PROBE_BUDGET`). Checks the head counts
    (:func:`rank_heads`), the parameters' head axes (:func:`head_axis`), :data:`HEAD_INDEXED`, then probes: the
    whole core and each rank's core (its parameters sliced by :func:`slice_parameters`) on one random prompt of
    :data:`PROBE_TOKENS` tokens and :data:`PROBE_STEPS` decode steps, float64; each rank's outputs must be the
    whole core's outputs of its heads."""
    from ...dispatch import Variant
    from ...nn import Attention

    try:
        ranks = [rank_heads(num_heads, num_kv_heads, size, r) for r in range(size)]
        plan = Variant(spec, "reference").plan
        for key, (_, p) in plan.param_specs().items():
            head_axis(key, p.shape)
    except IntegrationError as exc:
        return str(exc)
    for t in plan.transforms:
        if t.kind in HEAD_INDEXED:
            return f"transform '{t.kind}' cannot be split over tensor-parallel ranks: {HEAD_INDEXED[t.kind]}"
    evicting = spec.cache is not None
    keep = None if not evicting or budget is None else min(budget, PROBE_BUDGET)
    if evicting and size > num_kv_heads:
        probe = Attention(spec, num_heads, head_dim, num_kv_heads, backend="blocked").new_cache(1, budget=keep)
        evictor = probe.evictor
        if evictor is not None and evictor.needs_probabilities:
            return (f"evictor '{evictor.kind}' scores each key/value head by its group's query heads, which "
                    f"tensor_parallel_size {size} > {num_kv_heads} key/value heads splits over ranks")
    try:
        _probe(spec, ranks, head_dim, keep, Attention)
    except _Mismatch as exc:
        evictor = getattr(spec.cache, "evictor", None) if evicting else None
        return (f"its attention is not the same split over {size} tensor-parallel ranks ({exc}): a transform"
                f"{f' or the evictor {evictor!r}' if evictor else ''} mixes heads (e.g. scores averaged over all "
                f"heads, or a group of query heads split over ranks)")
    except Exception as exc:  # noqa: BLE001 -- a rank's core that cannot be built or run is a reason too
        return f"its core at {num_heads // size} query heads per rank fails: {exc}".replace("\n", " ")
    return None


class _Mismatch(Exception):
    pass


def _probe(spec, ranks: list[RankHeads], head_dim: int, budget: int | None, attention) -> None:
    """Raise :class:`_Mismatch` where a rank's core differs from the whole core on its heads (module doc)."""
    first = ranks[0]
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float64
    whole = attention(spec, first.num_heads, head_dim, first.num_kv_heads, backend="blocked", dtype=dtype)
    whole.requires_grad_(False)
    for value in whole.transform_params.values():
        value.add_(0.3 * torch.randn(value.shape, generator=gen, dtype=dtype))
    n = PROBE_TOKENS + PROBE_STEPS
    q = torch.randn(1, first.num_heads, n, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(1, first.num_kv_heads, n, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(1, first.num_kv_heads, n, head_dim, generator=gen, dtype=dtype)

    def run(core, q, k, v):
        cache = core.new_cache(1, budget=budget) if budget is not None else core.new_cache(1, budget=None)
        outs = [core.prefill(q[:, :, :PROBE_TOKENS], k[:, :, :PROBE_TOKENS], v[:, :, :PROBE_TOKENS], cache)]
        for t in range(PROBE_TOKENS, n):
            outs.append(core.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache))
        return torch.cat(outs, dim=2)

    want = run(whole, q, k, v)
    state = {f"transform_params.{name}": value for name, value in whole.transform_params.items()}
    for heads in ranks:
        core = attention(spec, len(heads.heads), head_dim, len(heads.kv_heads), backend="blocked", dtype=dtype)
        core.requires_grad_(False)
        for name, value in slice_parameters(state, core.variant.plan, heads).items():
            core.transform_params[name.split(".", 1)[1]].copy_(value)
        qs = q[:, heads.heads.start:heads.heads.stop]
        ks, vs = (t[:, heads.kv_heads.start:heads.kv_heads.stop] for t in (k, v))
        got = run(core, qs, ks, vs)
        if not torch.allclose(got, want[:, heads.heads.start:heads.heads.stop], rtol=1e-9, atol=1e-9):
            raise _Mismatch(f"rank {heads.rank}'s heads differ from the whole layer's on a probe")
