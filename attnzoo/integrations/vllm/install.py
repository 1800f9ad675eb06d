"""What attnzoo's vLLM plugin changes in vLLM, in each process vLLM starts (docs/vllm.md, "What attnzoo patches in
vLLM"): attnzoo's backend registered as vLLM's CPU attention (``backend.py``), the ring page's KV-cache spec
(``ring.py``), the checkpoint's guarded architecture names, and the two vLLM methods it wraps: the default model
loader's weight iterator (attnzoo's tensors are the backend's to read) and the platform's configuration check (a
declined spec refused at engine start)."""

from __future__ import annotations

import sys

from ..transformers.base import IntegrationError, is_core_key
from ..transformers.saving import ARCHITECTURE_PREFIX, guarded_architecture
from .spec import record_of
from .start import ServeDeclined, check_config

_INSTALLED = False
#: where vLLM imports the backend from (by name: the module subclasses vLLM's classes on first use)
BACKEND = f"{__package__}.backend.AttnzooCPUBackend"


def install() -> None:
    """Register attnzoo's backend in place of vLLM's CPU attention and filter attnzoo's tensors out of vLLM's weight
    loading (they are read by the backend). Refuses, in one line, a vLLM whose hooks moved."""
    global _INSTALLED
    if _INSTALLED:
        return
    try:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as exc:
        raise IntegrationError(f"attnzoo's vLLM plugin: this vLLM has no {exc.name} (written for vLLM "
                               f"{_tested()}): pip install 'attnzoo[vllm]'") from None
    if not hasattr(DefaultModelLoader, "get_all_weights"):
        raise IntegrationError(f"attnzoo's vLLM plugin: DefaultModelLoader.get_all_weights is gone from this vLLM "
                               f"(written for vLLM {_tested()})")
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    from . import ring  # the page of an evicting spec's layers, registered in every process

    ring.register()
    _register_guarded_architectures()
    original = DefaultModelLoader.get_all_weights

    def get_all_weights(self, model_config, model):
        ours = record_of(model_config.hf_config, model_config.model) is not None
        for name, tensor in original(self, model_config, model):
            if not (ours and is_core_key(name)):  # the tensors of attnzoo's cores: read by the backend
                yield name, tensor

    get_all_weights.__wrapped__ = original
    DefaultModelLoader.get_all_weights = get_all_weights
    _check_at_start()
    _INSTALLED = True


def _register_guarded_architectures() -> None:
    """A checkpoint saved by an applied model names its architectures with attnzoo's prefix
    (``AttnzooLlamaForCausalLM``: ``saving.guard_config``), so that vLLM without this plugin refuses it: here each
    of vLLM's architectures is registered under that name too, as the same model."""
    from vllm import ModelRegistry

    models = ModelRegistry.models
    for arch in list(models):
        if not arch.startswith(ARCHITECTURE_PREFIX):
            models.setdefault(guarded_architecture(arch), models[arch])


def _check_at_start() -> None:
    """Check a checkpoint's spec where vLLM checks its configuration, in the process that starts the engine (the
    user's): a declined spec, another platform than the CPU, or tensor/pipeline parallelism is refused there with
    one line, before any worker starts."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        try:
            check_config(vllm_config, current_platform.is_cpu())
        except ServeDeclined as exc:  # the one line first: vLLM's server ends it in a long traceback
            print(f"attnzoo: {exc}", file=sys.stderr, flush=True)
            raise

    platform.check_and_update_config = classmethod(check_and_update_config)


def _tested() -> str:
    from . import TESTED_VLLM

    return TESTED_VLLM
