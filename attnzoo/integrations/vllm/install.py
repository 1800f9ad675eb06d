"""What attnzoo's vLLM plugin changes in vLLM, in each process vLLM starts (docs/vllm.md, "What attnzoo patches in
vLLM"): attnzoo's backend registered as vLLM's CPU attention (``backend.py``), the ring page's KV-cache spec
(``ring.py``), the checkpoint's guarded architecture names, and the four vLLM methods it wraps: the default model
loader's weight iterator (attnzoo's tensors are the backend's to read), the platform's configuration check (a
declined spec refused at engine start), the model configuration's parallel check (heads that do not split over
tensor-parallel ranks refused in one line) and the model runner's ``_update_states`` (a finished request's staged
prompt dropped)."""

from __future__ import annotations

import sys

from ..transformers.base import IntegrationError, is_core_key
from ..transformers.saving import ARCHITECTURE_PREFIX, guarded_architecture
from .spec import record_of
from .start import ServeDeclined, check_config, check_heads

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
    _check_heads_first()
    _forget_finished_requests()
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
    user's): a declined spec, another platform than the CPU, pipeline parallelism or a spec that tensor parallelism
    cannot split is refused there with one line, before any worker starts."""
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


def _vllm_method(module: str, owner: str, name: str):
    """(the class ``owner`` of vLLM's ``module``, its method ``name``) to wrap, or one line saying which this vLLM
    lacks (the plugin was written for the vLLM of :func:`_tested`)."""
    import importlib

    try:
        cls = getattr(importlib.import_module(module), owner)
    except (ImportError, AttributeError) as exc:
        missing = getattr(exc, "name", None) or f"{module}.{owner}"
        raise IntegrationError(f"attnzoo's vLLM plugin: this vLLM has no {missing} (written for vLLM "
                               f"{_tested()})") from None
    original = getattr(cls, name, None)
    if original is None:
        raise IntegrationError(f"attnzoo's vLLM plugin: {owner}.{name} is gone from this vLLM (written for vLLM "
                               f"{_tested()})")
    return cls, original


def _check_heads_first() -> None:
    """Wrap ``ModelConfig.verify_with_parallel_config`` (run when vLLM builds its configuration, before the platform's
    check): an attnzoo checkpoint whose heads do not split over ``tensor_parallel_size`` ranks is refused in one line
    (``start.check_heads``) before vLLM's own check refuses it in a three-line validation report."""
    ModelConfig, original = _vllm_method("vllm.config.model", "ModelConfig", "verify_with_parallel_config")

    def verify_with_parallel_config(self, parallel_config):
        try:
            check_heads(self, parallel_config)
        except ServeDeclined as exc:  # the one line first, as _check_at_start says it
            print(f"attnzoo: {exc}", file=sys.stderr, flush=True)
            raise
        return original(self, parallel_config)

    verify_with_parallel_config.__wrapped__ = original
    ModelConfig.verify_with_parallel_config = verify_with_parallel_config


def finished_blocks(runner, scheduler_output) -> set[int]:
    """The first page (block) of every KV-cache group of the requests ``scheduler_output`` says finished or were
    preempted, as the model runner still holds them (``runner.requests[req_id].block_ids``)."""
    ended = set(scheduler_output.finished_req_ids) | set(getattr(scheduler_output, "preempted_req_ids", None) or ())
    blocks = set()
    for req_id in ended:
        state = runner.requests.get(req_id)
        for ids in getattr(state, "block_ids", None) or ():
            if ids:
                blocks.add(int(ids[0]))
    return blocks


def _forget_finished_requests() -> None:
    """Wrap the model runner's ``_update_states`` (the worker's first call of a step, with the scheduler's finished
    and preempted requests): an evicting spec's staged prompts (chunked prefill, ``layer.Layer._stage``) of those
    requests' pages are dropped before the original runs (it forgets the requests). Without it a request that ends
    with its prompt kept its staging until a new prompt started on its page."""
    GPUModelRunner, original = _vllm_method("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_update_states")
    GPUModelRunner._update_states = wrap_update_states(original)  # noqa: SLF001 -- vLLM's own, no public form (docs/vllm.md)


def wrap_update_states(original):
    """``original`` (the model runner's ``_update_states``), first dropping the staged prompts of the pages of the
    requests that finished or were preempted (:func:`finished_blocks`, ``layer.drop_staged``)."""
    from .layer import drop_staged

    def _update_states(self, scheduler_output):
        blocks = finished_blocks(self, scheduler_output)
        if blocks:
            drop_staged(blocks)
        return original(self, scheduler_output)

    _update_states.__wrapped__ = original
    return _update_states


def _tested() -> str:
    from . import TESTED_VLLM

    return TESTED_VLLM
