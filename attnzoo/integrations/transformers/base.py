"""Names and errors shared by the parts of the transformers integration."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import AttnzooError
from ...nn import Attention

#: The name under which the attention and mask functions are registered with transformers.
ATTN_IMPLEMENTATION = "attnzoo"
#: Name of the attnzoo core submodule on each attention module, and of the record in the model config.
CORE_NAME = "attnzoo"
CONFIG_KEY = "attnzoo"
#: Substring that marks the transforms' parameters in a state dict / checkpoint (a part of :data:`CORE_MARK`).
PARAM_MARK = f".{CORE_NAME}.transform_params."
#: Substring that marks every tensor an attnzoo core owns in a state dict / checkpoint: the transforms' parameters
#: (``transform_params``), the projections of the layer input for per-token inputs (``token_projections``, weights
#: and biases) and anything else under the core submodule. Checkpoints save, hide from transformers' load report,
#: restore and serve exactly these keys (:func:`is_core_key`).
CORE_MARK = f".{CORE_NAME}."


def is_core_key(key: str) -> bool:
    """Whether state-dict / checkpoint key ``key`` names a tensor of an attnzoo core (:data:`CORE_MARK`)."""
    return CORE_MARK in f".{key}"
#: What ``save_pretrained`` of an applied model writes as ``attn_implementation`` in ``config.json``: transformers
#: refuses to load the checkpoint with it (it is registered nowhere) and its error names attnzoo's loader, so a
#: plain ``AutoModelForCausalLM.from_pretrained`` cannot silently build the model without its spec.
CHECKPOINT_GUARD = "attnzoo-checkpoint (load it with attnzoo.integrations.transformers.from_pretrained)"

UNSET: Any = object()


class IntegrationError(AttnzooError, ValueError):
    """The transformers integration cannot do what was asked; the message is one line."""


class ProbeError(IntegrationError):
    """The probe's forward pass could not run, or could not be read, where the model is (e.g. on the meta device:
    :func:`~attnzoo.integrations.transformers.core.config_native_layers` then builds it small on the CPU)."""


class FamilyWarning(UserWarning):
    """A model family where transformers' own computation keeps attnzoo from matching some result of transformers:
    its cache keeps fewer keys than its mask attends to (moshi), or it scales queries by their index in the call
    rather than their position (Llama 4's temperature tuning, under left padding). One line naming the family or
    the module and the reason (docs/transformers.md, "Family notes")."""


class FunctionWarning(UserWarning):
    """A spec whose transforms change what a pretrained model's attention computes before any token is evicted
    (selective attention's mask, temperatures away from 1): measured at :func:`apply` on a random probe of the first
    layer against the layer's own attention. One line with the measured change; such a spec needs training (a
    fine-tune) before it serves a pretrained checkpoint; evictor-only specs keep the model's function
    (docs/transformers.md, "Which specs keep a pretrained model's function")."""


class CheckpointSpecMismatchError(IntegrationError):
    """A checkpoint was saved with another spec than the model's (the message names the file and both hashes)."""


def where(module) -> str:
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


#: how a composition conflict between the model's native attention and the spec is settled (``apply(prefer=...)``)
PREFER = ("error", "model", "spec")


def applied_modules(model) -> list[torch.nn.Module]:
    if not is_applied(model):
        raise IntegrationError(f"{type(model).__name__}: call attnzoo.integrations.transformers.apply(model, spec) "
                               f"first")
    found = [m for m in model.modules() if isinstance(getattr(m, CORE_NAME, None), Attention)
             and getattr(getattr(m, CORE_NAME), "hf_call", None) is not None]
    return sorted(found, key=lambda m: m.layer_idx)


def is_applied(model) -> bool:
    """Whether :func:`apply` has been run on ``model`` (its config carries the record, its layers the cores)."""
    record = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if not isinstance(record, dict) or getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        return False
    return any(isinstance(getattr(m, CORE_NAME, None), Attention) for m in model.modules())


def cache_argument(model) -> str:
    """The name under which the installed transformers passes the cache to the model: ``cache`` (transformers
    5.20 on), ``past_key_values`` before (5.19, which vLLM's CPU build pins)."""
    import inspect

    try:
        names = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return "cache"
    return "past_key_values" if "past_key_values" in names and "cache" not in names else "cache"
