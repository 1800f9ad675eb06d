"""The Triton fragments of a plan's transforms rendered in torch (``tl.<name>`` as ``torch.<name>``), to name the
fragment that gives non-finite values where the torch maths before it is finite: :func:`fragment_culprit`, which
the suite's tolerance rule (:func:`.checks.close`) asks when the backend under test runs the fragments (triton).
"""

from __future__ import annotations

import torch

from ..transforms.base import Dims, Slot


class _TorchTL:
    """``triton.language`` as far as fragments use it, rendered in torch: ``tl.<name>`` is ``torch.<name>`` (with
    Python numbers as tensors), and the dtypes. A name torch lacks raises, and the fragment is not traced."""

    float16, bfloat16, float32, float64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
    int1, int8, int16, int32, int64 = torch.bool, torch.int8, torch.int16, torch.int32, torch.int64

    def __getattr__(self, name):
        fn = getattr(torch, name, None)
        if name.startswith("_") or not callable(fn):
            raise AttributeError(name)
        return lambda *args, **kw: fn(*(torch.as_tensor(a) if isinstance(a, (bool, int, float)) else a
                                        for a in args), **kw)


def _first_bad(value, where: torch.Tensor, allow_neg_inf: bool) -> tuple | None:
    """The (b, h, i, j) index of the first non-finite entry of ``value`` at a True entry of ``where``, or None."""
    value = torch.as_tensor(value).expand_as(where)
    bad = (torch.isnan(value) | torch.isposinf(value)) if allow_neg_inf else ~torch.isfinite(value)
    hits = (bad & where).nonzero()
    return tuple(int(i) for i in hits[0].tolist()) if len(hits) else None


def fragment_culprit(plan, q, k, v, params, positions, key_mask=None) -> str | None:
    """The first Triton fragment (logits slot in spec order, then the accumulator's) that gives non-finite values
    at a pair that may attend, evaluated in torch (``_TorchTL``) on float32 logits as the kernels compute them, each
    fragment on the torch maths' output of the transforms before it; as one phrase, or None (no fragment does, or
    the fragments could not be rendered in torch). The kernels discard a fragment's value at every other pair."""
    from ..backends.triton.codegen import host_termed

    tl = _TorchTL()
    q, k, v = q.float(), k.float(), v.float()
    params = {kind: {n: p.float() for n, p in group.items()} for kind, group in params.items()}
    pos = positions.unsqueeze(1)
    dims = Dims(q.shape[1], q.shape[3], k.shape[1])
    with torch.no_grad():
        qs, ks, vs = (plan.composition.row_scale(slot, x, pos, params, widen=True)
                      for slot, x in ((Slot.QUERY, q), (Slot.KEY, k), (Slot.VALUE, v)))
        features = plan.composition.token_features(qs, ks, vs, positions, key_mask, params)
        ctx = plan.composition.context(positions, pos, dims, key_mask, features, features)
        group = dims.num_heads // dims.num_kv_heads
        x = (qs @ ks.repeat_interleave(group, dim=1).transpose(-1, -2)) * plan.logit_scale(dims.head_dim)
        allowed = plan.composition.allowed(ctx, key_mask).expand_as(x)

        def blame(t, slot, field, text, value, where, allow_neg_inf, context):
            hit = _first_bad(value, where, allow_neg_inf)
            if hit is None:
                return None
            b, h, i, j = hit
            heads = context.heads.flatten().tolist()
            what = "NaN" if bool(torch.isnan(torch.as_tensor(value).expand_as(where)[hit])) else "inf"
            return (f"non-finite values first appear in transform '{t.kind}' ({slot} slot): its Triton fragment "
                    f"{field} {text!r} gives {what} at query position {int(positions[b, i])}, key position "
                    f"{int(positions[b, j])} (batch row {b}, head {heads[h]}), a pair that may attend, where the "
                    f"torch maths before it is finite (the transform's Triton lowering, not the backend)")

        try:
            for t in plan.many(Slot.LOGITS):
                low = None if host_termed(plan, t) else t.triton()
                if low is not None:
                    names = {f"p_{name}": f"p{i}" for i, name in enumerate(low.params)}
                    env = {"__builtins__": {}, "tl": tl, "qp": ctx.qpos, "kp": ctx.kpos, "head": ctx.heads,
                           "H": dims.num_heads, "x": x,
                           **{f"p{i}": params[t.kind][name][ctx.heads] for i, name in enumerate(low.params)}}
                    y = eval(low.forward.format(x="x", **names), env)  # the plugin's own fragment, rendered in torch
                    found = blame(t, "logits", "forward", low.forward, y, allowed, True, ctx)
                    if found:
                        return found
                    env["y"] = y
                    finite = allowed & torch.isfinite(torch.as_tensor(y).expand_as(allowed))
                    for field, text in (("derivative", low.derivative),
                                        *((f"param_derivatives[{i}]", e) for i, e in enumerate(low.param_derivatives))):
                        value = eval(text.format(x="x", y="y", **names), env)
                        found = blame(t, "logits", field, text, value, finite, False, ctx)
                        if found:
                            return found
                x = t.apply(x, ctx, params[t.kind])
            acc = plan.one(Slot.ACCUMULATOR)
            low = acc.triton() if acc is not None else None
            if low is not None:
                index, ok, sel_ctx = plan.composition.selector_view(acc, allowed, ctx)
                xs = x.index_select(1, index)
                ok = ok.expand_as(xs)
                env = {"__builtins__": {}, "tl": tl, "qp": sel_ctx.qpos, "kp": sel_ctx.kpos, "head": sel_ctx.heads,
                       "H": dims.num_heads, "ok": ok, "x": xs}
                keep = ok & torch.as_tensor(eval(low.keep, env)).expand_as(ok) if low.keep else ok
                for field, text in (("value", low.value), ("derivative", low.derivative)):
                    found = blame(acc, "accumulator", field, text, eval(text.format(x="x"), env), keep, False,
                                  sel_ctx)
                    if found:
                        return found
        except Exception:  # a fragment torch cannot render (a Triton-only function, say): not traced
            return None
    return None
