"""``attnzoo.nn.Attention``: a spec's attention core as a torch module that owns the transforms' parameters.

It takes already projected (and RoPE'd) q, k, v, like ``scaled_dot_product_attention``, so it drops into an
existing attention layer in place of that call. Parameter names are the params keys with ``.`` replaced by
``__`` (``query_temperature__token_weight``), because torch module names cannot contain dots.
"""

from __future__ import annotations

import torch

from .dispatch import compile as compile_spec


class Attention(torch.nn.Module):
    """Attention core of ``spec``: ``forward(q, k, v, positions=None, key_mask=None)``; decoding with
    ``new_cache`` and ``decode``."""

    def __init__(self, spec, num_heads: int, head_dim: int, num_kv_heads: int | None = None, backend: str = "auto",
                 dtype: torch.dtype = torch.float32, device=None, registry=None) -> None:
        super().__init__()
        self.variant = compile_spec(spec, backend=backend, registry=registry)
        initial = self.variant.init_params(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads,
                                           dtype=dtype, device=device)
        self.transform_params = torch.nn.ParameterDict(
            {key.replace(".", "__"): torch.nn.Parameter(value) for key, value in initial.items()})

    @property
    def spec(self):
        return self.variant.spec

    def params(self) -> dict[str, torch.Tensor]:
        """The parameters keyed as the variant expects them (``"<kind>.<name>"``)."""
        return {key.replace("__", "."): value for key, value in self.transform_params.items()}

    def forward(self, q, k, v, positions=None, key_mask=None):
        return self.variant(q, k, v, params=self.params(), positions=positions, key_mask=key_mask)

    def new_cache(self, batch: int, **kwargs):
        return self.variant.new_cache(batch=batch, **kwargs)

    def decode(self, q_t, k_t, v_t, cache):
        """One new token: q_t (B, H, 1, D), k_t and v_t (B, H_kv, 1, D) → the output (B, H, 1, D).

        Decoding is inference, with or without ``torch.no_grad()``: the cache keeps detached keys, values,
        positions and F between steps, so memory and the autograd graph do not grow with the tokens decoded. The
        output's gradient reaches this step's q_t, k_t, v_t and the transform parameters (through this step's
        computation); earlier steps' rows and the F carried from them are constants. Train with the batch form."""
        return self.variant.decode(q_t, k_t, v_t, cache, params=self.params())

    def parameter_groups(self, lr_scale: float = 1.0) -> list[dict]:
        """The transforms' parameters as one optimizer group without weight decay (the SSA authors train their
        temperature scalars that way, often at a higher learning rate: pass ``lr_scale`` and multiply it into
        the group's ``lr`` in your optimizer set-up)."""
        return [{"params": list(self.transform_params.values()), "weight_decay": 0.0, "lr_scale": lr_scale}]

    def extra_repr(self) -> str:
        return f"spec='{self.spec.name}', backend='{self.variant.backend_name}'"
