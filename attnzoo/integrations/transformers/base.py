"""Names and errors shared by the parts of the transformers integration."""

from __future__ import annotations

from typing import Any

from ...errors import AttnzooError

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


class CheckpointSpecMismatchError(IntegrationError):
    """A checkpoint was saved with another spec than the model's (the message names the file and both hashes)."""


def where(module) -> str:
    return f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
