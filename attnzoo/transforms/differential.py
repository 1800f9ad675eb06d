"""Differential attention (Ye et al., "Differential Transformer", ICLR 2025), docs/specs.md.

The paper splits each head's queries and keys in two, takes two softmaxes and subtracts them,
``(softmax(Q1 K1ᵀ) - λ softmax(Q2 K2ᵀ)) V`` with V twice as wide, then normalises each head's output (RMSNorm over
its 2d values, "subln") and scales it by (1 - λ_init). Here the two halves are two attnzoo heads: heads are taken in
pairs (2p, 2p + 1), ``A_h = softmax(L_h)``, and both heads of pair p weigh ``W = A_2p - λ A_2p+1`` against their own
values, head 2p getting ``W V_2p`` and head 2p+1 ``W V_2p+1``: the paper's form exactly, its 2d-wide value split into
the two heads' d halves. As a probability map: each head's map is its own softmax (:class:`OnlineSoftmax`),
``values`` gives both heads of a pair ``[V_2p | V_2p+1]`` and ``combine`` takes ``O_2p - λ O_2p+1`` and hands each
head its half.

``λ = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init`` with four learnable vectors of size D (the paper's per-layer
vectors; they start at a small fixed pattern, not at 0, where their gradients would vanish: the paper draws them
from N(0, 0.1²)). ``λ_init`` is an option (the paper's depth schedule ``0.8 - 0.6 exp(-0.3 (l - 1))`` for layer l
is per layer: give each layer its spec with its value). ``diff_norm`` (slot ``output``) is the paper's subln: RMSNorm
over a pair's 2D outputs with a learnable gain, times (1 - λ_init).

With grouped keys (GQA) the pairs are of query heads: heads 2p and 2p + 1 read the key/value heads attnzoo's grouping
gives them (h // (H / H_kv)), which may be one and the same.
"""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Dims, ParamSpec, ProbabilityTransform, RowMapTransform, Slot, TransformOptions
from .probability import OnlineSoftmax


def check_pairs(kind: str, dims: Dims) -> None:
    if dims.num_heads % 2:
        raise ValueError(f"{kind} takes the query heads in pairs (2p, 2p + 1): it needs an even number of heads, "
                         f"the call has {dims.num_heads}")


def _initial_vector(seed: int):
    """A small deterministic pattern of size D (the paper draws N(0, 0.1²)): nonzero, so that λ's gradient is."""
    def init(dims: Dims) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return 0.1 * torch.randn(dims.head_dim, generator=gen, dtype=torch.float64)

    return init


class DiffOptions(TransformOptions):
    lambda_init: float = Field(0.8, description="λ_init of the layer (the paper: 0.8 - 0.6 exp(-0.3 (l - 1)) "
                               "for layer l; 0.8 by default)")


class Diff(OnlineSoftmax, ProbabilityTransform):
    """Differential attention's map: per head its softmax; pairs of heads share ``W = A_2p - λ A_2p+1``."""

    kind = "diff"
    slot = Slot.PROBABILITY
    Options = DiffOptions
    summary = "differential attention (Ye et al.): heads in pairs weigh softmax(L_2p) - λ softmax(L_2p+1)"

    def parameters(self):
        return [ParamSpec(name, ("D",), _initial_vector(seed))
                for seed, name in enumerate(("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"), start=1)]

    def check_dims(self, dims):
        check_pairs(self.kind, dims)

    def lam(self, params) -> torch.Tensor:
        """λ = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init, a scalar tensor."""
        first = torch.exp((params["lambda_q1"] * params["lambda_k1"]).sum())
        second = torch.exp((params["lambda_q2"] * params["lambda_k2"]).sum())
        return first - second + self.options.lambda_init

    def values(self, vs, params):
        """(B, H, Nk, D) → (B, H, Nk, 2D): both heads of pair p get [V_2p | V_2p+1]."""
        b, h, n, d = vs.shape
        pairs = vs.reshape(b, h // 2, 2, n, d).transpose(2, 3).reshape(b, h // 2, 1, n, 2 * d)
        return pairs.expand(b, h // 2, 2, n, 2 * d).reshape(b, h, n, 2 * d)

    def combine(self, out, params):
        """(B, H, Nq, 2D) → (B, H, Nq, D): O_2p - λ O_2p+1, its first half to head 2p, its second to head 2p+1."""
        b, h, n, d2 = out.shape
        pairs = out.reshape(b, h // 2, 2, n, d2)
        lam = self.lam(params).to(out.dtype)
        diff = pairs[:, :, 0] - lam * pairs[:, :, 1]  # (B, H/2, Nq, 2D)
        return diff.reshape(b, h // 2, n, 2, d2 // 2).transpose(2, 3).reshape(b, h, n, d2 // 2)


class DiffNormOptions(TransformOptions):
    lambda_init: float = Field(0.8, description="λ_init of the layer, as the spec's diff transform has it: the "
                               "output is scaled by (1 - λ_init)")
    eps: float = Field(1e-5, gt=0, description="added to the mean square (the paper's RMSNorm: 1e-5)")


class DiffNorm(RowMapTransform):
    """The paper's per-head normalisation of differential attention (subln): for each pair of heads (2p, 2p + 1)
    of a token, RMSNorm over its 2D outputs ``[out_2p | out_2p+1]`` with a learnable gain of 2D values (shared by
    the pairs), times ``(1 - λ_init)``. Computed in at least float32."""

    kind = "diff_norm"
    slot = Slot.OUTPUT
    Options = DiffNormOptions
    summary = "differential attention's subln: RMSNorm over each head pair's 2D outputs, times (1 - λ_init)"

    def check_spec(self, spec):
        diff = next((t for t in spec.transforms if t.kind == "diff"), None)
        if diff is None:
            return "diff_norm normalises differential attention's head pairs: the spec needs the transform 'diff'"
        if diff.lambda_init != self.options.lambda_init:
            return (f"diff_norm.lambda_init ({self.options.lambda_init}) differs from diff.lambda_init "
                    f"({diff.lambda_init}): the paper scales by (1 - λ_init) of the same layer")
        return None

    def check_dims(self, dims):
        check_pairs(self.kind, dims)

    def parameters(self):
        return [ParamSpec("gain", (2, "D"), 1.0)]

    def map(self, rows, positions, params):
        b, h, n, d = rows.shape
        dtype = torch.promote_types(rows.dtype, torch.float32)
        pairs = rows.to(dtype).reshape(b, h // 2, 2, n, d).transpose(2, 3).reshape(b, h // 2, n, 2 * d)
        gain = params["gain"].to(dtype).reshape(2 * d)
        normed = torch.nn.functional.rms_norm(pairs, (2 * d,), weight=gain, eps=self.options.eps)
        normed = normed * (1.0 - self.options.lambda_init)
        return normed.reshape(b, h // 2, n, 2, d).transpose(2, 3).reshape(b, h, n, d)
