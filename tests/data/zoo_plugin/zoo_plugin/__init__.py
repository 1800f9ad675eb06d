"""A third-party plugin as a user writes it from docs/plugins.md: QK-norm with a per-dimension gain (a row map) and
the Forgetting Transformer with a token-dependent gate (a per-token feature), each well under 60 lines."""

from pathlib import Path

import torch
import torch.nn.functional as F

import attnzoo


class UserQKNormOptions(attnzoo.TransformOptions):
    eps: float = 1e-6


class UserQueryNorm(attnzoo.RowMapTransform):
    kind = "user_query_norm"
    slot = attnzoo.Slot.QUERY
    Options = UserQKNormOptions

    def parameters(self):
        return [attnzoo.ParamSpec("gain", ("D",), 1.0)]

    def map(self, rows, positions, params):
        x = rows.float() if rows.dtype in (torch.float16, torch.bfloat16) else rows
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.options.eps) * params["gain"].to(x.dtype)


class UserKeyNorm(UserQueryNorm):
    kind = "user_key_norm"
    slot = attnzoo.Slot.KEY


class UserForgetting(attnzoo.LogitsTransform):
    kind = "user_forgetting"
    slot = attnzoo.Slot.LOGITS
    cumulative = frozenset({"D"})

    def parameters(self):
        return [attnzoo.ParamSpec("w", ("H", "D"), 0.0), attnzoo.ParamSpec("b", ("H",), 3.0)]

    def features(self, rows, params):
        wide = torch.promote_types(rows.k.dtype, torch.float32)  # float32 for half inputs, float64 stays
        k = rows.k.to(wide).repeat_interleave(rows.dims.num_heads // rows.dims.num_kv_heads, dim=1)
        gate = torch.einsum("bhnd,hd->bhn", k, params["w"].to(wide)) + params["b"].to(wide)[:, None]
        return {"D": F.logsigmoid(gate)}

    def apply(self, logits, ctx, params):
        return logits + self.bias(ctx, params, logits.dtype)

    def bias(self, ctx, params, dtype):
        d_query, d_key = ctx.features(self.kind, "D")
        return (d_query - d_key).to(dtype)

    def separable(self, ctx, params, dtype):  # D_i + (-D_j): folded into the keys (blocked), per-token terms (triton)
        d_query, d_key = ctx.features(self.kind, "D")
        return d_query.to(dtype), (-d_key).to(dtype)


@attnzoo.hookimpl
def register_transforms(register):
    for cls in (UserQueryNorm, UserKeyNorm, UserForgetting):
        register(cls)


@attnzoo.hookimpl
def register_specs(register):
    for name in ("user-qk-norm.yaml", "user-forgetting.yaml"):
        register(Path(__file__).with_name(name))
