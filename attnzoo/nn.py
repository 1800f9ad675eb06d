"""``attnzoo.nn``: a spec's attention core as a torch module that owns the transforms' parameters, plus the
helpers a training loop needs (optimizer groups, the selective memory loss summed over layers).

``Attention`` takes already projected (and RoPE'd) q, k, v, like ``scaled_dot_product_attention``, so it drops
into an existing attention layer in place of that call. Parameter names are the params keys with ``.`` replaced
by ``__`` (``query_temperature__token_weight``), because torch module names cannot contain dots.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .dispatch import compile as compile_spec
from .transforms.selective import memory_loss


class Attention(torch.nn.Module):
    """Attention core of ``spec``: ``forward(q, k, v, positions=None, key_mask=None, return_accumulated=False,
    x=None)``; decoding with ``new_cache``, ``prefill`` and ``decode``.

    A spec whose transforms take per-token inputs from the layer input (``Transform.token_inputs``, e.g. the
    forgetting gate with ``source: input``) needs ``input_dim`` (the width E of x): the module then owns one linear
    map E → H per input (``token_projections``; weight 0, bias at the input's ``bias_init``; ordinary weights of the
    model for :func:`parameter_groups`) and each call takes the layer input ``x`` (B, N, E)."""

    def __init__(self, spec, num_heads: int, head_dim: int, num_kv_heads: int | None = None, backend: str = "auto",
                 dtype: torch.dtype = torch.float32, device=None, registry=None, input_dim: int | None = None) -> None:
        super().__init__()
        self.variant = compile_spec(spec, backend=backend, registry=registry)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        initial = self.variant.init_params(num_heads=num_heads, head_dim=head_dim, num_kv_heads=num_kv_heads,
                                           dtype=dtype, device=device)
        self.transform_params = torch.nn.ParameterDict(
            {key.replace(".", "__"): torch.nn.Parameter(value) for key, value in initial.items()})
        self._recording: list[torch.Tensor] | None = None
        self._bound: dict[str, tuple[torch.nn.Module, str]] = {}  # params key -> (owner module, attribute)
        wanted = self.variant.plan.token_inputs()
        if wanted and input_dim is None:
            raise ValueError(f"spec '{self.variant.spec.name}' takes per-token inputs from the layer input "
                             f"({', '.join(wanted)}): pass input_dim (the width of x)")
        projections = {}
        for key, (_, declared) in wanted.items():
            linear = torch.nn.Linear(input_dim, num_heads, dtype=dtype, device=device)
            torch.nn.init.zeros_(linear.weight)
            torch.nn.init.constant_(linear.bias, declared.bias_init)
            projections[key.replace(".", "__")] = linear
        self.token_projections = torch.nn.ModuleDict(projections)

    @property
    def spec(self):
        return self.variant.spec

    def params(self) -> dict[str, torch.Tensor]:
        """The parameters keyed as the variant expects them (``"<kind>.<name>"``), bound ones included."""
        out = {key.replace("__", "."): value for key, value in self.transform_params.items()}
        for key, (owner, attribute) in self.__dict__.get("_bound", {}).items():
            out[key] = getattr(owner, attribute)
        return out

    def bind_parameter(self, key: str, owner: torch.nn.Module, attribute: str) -> None:
        """Use ``owner.<attribute>`` (a parameter the host model already owns, such as gpt-oss's ``sinks``) as the
        transform parameter ``key`` (``"<kind>.<name>"``) instead of a parameter of this module: it keeps the
        host's name in ``state_dict()`` and checkpoints, and trains as one of the host's parameters. Its shape must
        be the transform's."""
        name = key.replace(".", "__")
        if name not in self.transform_params:
            raise ValueError(f"spec '{self.spec.name}' has no transform parameter '{key}' to bind")
        value = getattr(owner, attribute)
        want = tuple(self.transform_params[name].shape)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{type(owner).__name__}.{attribute} has shape {got}, the transform parameter '{key}' "
                             f"needs {want}")
        del self.transform_params[name]
        self._bound[key] = (owner, attribute)

    @property
    def bound_parameters(self) -> dict[str, tuple[torch.nn.Module, str]]:
        """Transform parameters owned by the host model: ``{"<kind>.<name>": (owner module, attribute)}``."""
        return dict(self.__dict__.get("_bound", {}))

    def token_inputs(self, x: torch.Tensor | None, tokens: int) -> dict[str, torch.Tensor] | None:
        """The per-token inputs ``{"<kind>.<name>": (B, H, N)}`` projected from the layer input x (B, N, E), or
        None for a spec that takes none."""
        if not len(self.token_projections):
            return None
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[1] != tokens:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"spec '{self.spec.name}' computes per-token inputs from the layer input: pass x "
                             f"(B, N, E) with N = {tokens}, got {got}")
        return {key.replace("__", "."): proj(x).transpose(1, 2) for key, proj in self.token_projections.items()}

    def forward(self, q, k, v, positions=None, key_mask=None, return_accumulated: bool = False,
                x: torch.Tensor | None = None, documents=None):
        """The batch form (training, or a whole sequence): q (B, H, N, D), k and v (B, H_kv, N, D). With
        ``return_accumulated`` also returns F (B, N, N) (None without an accumulator); inside
        :func:`recording_accumulated` F is recorded for the memory loss either way. ``documents``: packed input
        (docs/packing.md)."""
        want = return_accumulated or (self._recording is not None and self.has_accumulator)
        result = self.variant(q, k, v, params=self.params(), positions=positions, key_mask=key_mask,
                              return_accumulated=want, inputs=self.token_inputs(x, q.shape[2]), documents=documents)
        if not want:
            return result
        out, accumulated = result
        if self._recording is not None and accumulated is not None:
            self._recording.append(accumulated)
        return (out, accumulated) if return_accumulated else out

    @property
    def has_accumulator(self) -> bool:
        return "accumulator" in self.spec.slots()

    def new_cache(self, batch: int, **kwargs):
        return self.variant.new_cache(batch=batch, **kwargs)

    def prefill(self, q, k, v, cache, key_mask=None, x=None):
        """Several new tokens (B, H, T, D) into ``cache``: they attend over it and each other; ``key_mask`` (B, T)
        marks left padding (docs/decoding.md); ``x`` (B, T, E): their layer input, for specs that need it."""
        return self.variant.prefill(q, k, v, cache, params=self.params(), key_mask=key_mask,
                                    inputs=self.token_inputs(x, q.shape[2]))

    def decode(self, q_t, k_t, v_t, cache, key_mask=None, x=None):
        """One new token: q_t (B, H, 1, D), k_t and v_t (B, H_kv, 1, D) → the output (B, H, 1, D).

        Decoding is inference, with or without ``torch.no_grad()``: the cache keeps detached keys, values,
        positions and F between steps, so memory and the autograd graph do not grow with the tokens decoded. The
        output's gradient reaches this step's q_t, k_t, v_t and the transform parameters (through this step's
        computation); earlier steps' rows and the F carried from them are constants. Train with the batch form.
        ``x`` (B, 1, E): the token's layer input, for specs that need it."""
        return self.variant.decode(q_t, k_t, v_t, cache, params=self.params(), key_mask=key_mask,
                                   inputs=self.token_inputs(x, 1))

    def parameter_groups(self, lr: float | None = None, weight_decay: float = 0.0) -> list[dict]:
        """The transforms' parameters as one optimizer group, without weight decay by default (the SSA authors
        train their temperature scalars that way, often at a higher learning rate). ``lr`` sets the group's own
        learning rate (omitted: the optimizer's default applies)."""
        group = {"params": list(self.transform_params.values()), "weight_decay": weight_decay}
        if lr is not None:
            group["lr"] = lr
        return [group]

    def extra_repr(self) -> str:
        return f"spec='{self.spec.name}', backend='{self.variant.backend_name}'"


def attention_layers(model: torch.nn.Module) -> Iterator[Attention]:
    """Every :class:`Attention` inside ``model``, in module order."""
    return (m for m in model.modules() if isinstance(m, Attention))


def parameter_groups(model: torch.nn.Module, lr: float, transform_lr: float | None = None,
                     weight_decay: float | None = None, transform_weight_decay: float = 0.0) -> list[dict]:
    """Optimizer groups for a whole model: the attnzoo transforms' parameters (``transform_lr``, default ``lr``;
    no weight decay by default) and every other trainable parameter (``lr``; ``weight_decay`` only when given:
    otherwise the optimizer's own default applies to the model's parameters, as without attnzoo). Each group
    carries its own ``lr``, so ``torch.optim.AdamW(parameter_groups(model, lr=3e-4, transform_lr=3e-3))``
    really trains the temperatures ten times faster."""
    transform = {id(p): p for layer in attention_layers(model) for p in layer.transform_params.values()}
    rest = [p for p in model.parameters() if id(p) not in transform and p.requires_grad]
    groups = [{"params": rest, "lr": lr}]
    if weight_decay is not None:
        groups[0]["weight_decay"] = weight_decay
    if transform:
        groups.append({"params": list(transform.values()), "lr": lr if transform_lr is None else transform_lr,
                       "weight_decay": transform_weight_decay})
    return groups


class AccumulatedRecord:
    """The F of every accumulator layer recorded during a forward pass (see :func:`recording_accumulated`)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def memory_loss(self, tau: float = 1.0, eps: float = 0.1) -> torch.Tensor:
        """Selective attention's auxiliary memory loss over the recorded layers (``attnzoo.memory_loss``)."""
        if not self.tensors:
            raise ValueError("no layer recorded an F: the model has no attnzoo layer with an accumulator, or no "
                             "forward pass ran inside recording_accumulated()")
        return memory_loss(self.tensors, tau=tau, eps=eps)


@contextmanager
def recording_accumulated(model: torch.nn.Module) -> Iterator[AccumulatedRecord]:
    """Record the F of every attnzoo layer with an accumulator during the forward passes run inside::

        with attnzoo.nn.recording_accumulated(model) as record:
            loss = lm_loss(model(x))
        loss = loss + record.memory_loss()
    """
    record = AccumulatedRecord()
    layers = list(attention_layers(model))
    for layer in layers:
        layer._recording = record.tensors  # noqa: SLF001 -- Attention's own field, set by its own module
    try:
        yield record
    finally:
        for layer in layers:
            layer._recording = None  # noqa: SLF001
