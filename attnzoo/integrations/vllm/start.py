"""What attnzoo's vLLM backend checks where vLLM checks its configuration, in the process that starts the engine
(docs/vllm.md, "What is declined, and why"): a checkpoint's record and spec, the platform and parallelism, the
layers' windows and chunks, and, for an evicting spec, the settings that would change a pruned history."""

from __future__ import annotations

import logging

from ...errors import AttnzooError
from ...spec import load_spec
from ..transformers.base import IntegrationError
from .spec import declined, record_of

_LOG = logging.getLogger(__name__)


class ServeDeclined(AttnzooError):
    """A checkpoint's spec vLLM cannot serve exactly, refused when vLLM checks its configuration (not a
    ``ValueError``: vLLM's configuration model would wrap it in a validation report; this stays one line)."""


def check_config(vllm_config, on_cpu: bool) -> None:
    """Refuse, in one line, what attnzoo's vLLM backend cannot serve exactly (nothing for a checkpoint without an
    attnzoo record), and a malformed record (naming ``config.json`` and the field, as ``zt.from_pretrained`` refuses
    it: :func:`~attnzoo.integrations.transformers.records.check_record`)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return
    try:
        record = record_of(getattr(model_config, "hf_config", None), getattr(model_config, "model", None))
    except IntegrationError as exc:  # not a ValueError here: vLLM's configuration model would wrap it in a report
        raise ServeDeclined(str(exc)) from None
    if record is None:
        return
    where = f"{model_config.model}: attnzoo spec '{record['name']}'"
    if not on_cpu:
        raise ServeDeclined(f"{where}: attnzoo's vLLM backend runs on the CPU in this release; on this platform "
                               f"vLLM would run its own attention, not the spec")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ServeDeclined(f"{where}: {PIPELINE_REASON.format(size=parallel.pipeline_parallel_size)}")
    user = load_spec(record["spec"])
    reason = declined(user)
    if reason:
        raise ServeDeclined(f"{where}: cannot be served by vLLM: {reason}")
    if parallel.tensor_parallel_size > 1:  # before an evicting spec's settings are changed and said
        _serve_split(model_config, record, user, parallel.tensor_parallel_size, where)
    if user.cache is not None:
        _serve_pruned(vllm_config, record, where)
    chunk = chunk_size(model_config)
    if chunk:
        raise ServeDeclined(f"{where}: {CHUNKED_REASON.format(chunk=chunk)}")
    mixed = mixed_windows(model_config)
    if mixed:
        raise ServeDeclined(f"{where}: {mixed}")


#: why pipeline parallelism is declined: checked with a plain Llama, no plugin, pipeline_parallel_size=2, the mp
#: executor, enforce_eager: the second stage's worker asserts at its first step (CPUModelRunner.warming_up_model skips
#: the dummy run under CompilationMode.NONE, and only GPUModelRunner._dummy_run allocates a later stage's
#: intermediate tensors); compiled mode (minutes to start on a CPU) was not tried
PIPELINE_REASON = ("pipeline parallelism (pipeline_parallel_size {size}) is not served: not checked with attnzoo's "
                   "backend, and vLLM 0.32's CPU platform fails a second stage's first step without attnzoo too under "
                   "enforce_eager (GPUModelRunner.sync_and_gather_intermediate_tensors asserts: its warm-up, skipped "
                   "in eager mode, allocates the stage's intermediate tensors); tensor_parallel_size splits the heads "
                   "instead (docs/vllm.md, \"Tensor parallel\")")


def check_heads(model_config, parallel_config) -> None:
    """Refuse, in one line, an attnzoo checkpoint whose heads do not split over ``tensor_parallel_size`` ranks
    (:func:`~.tp.rank_heads`), before vLLM's own check says so in a three-line validation report (``install.py``
    runs this first in ``ModelConfig.verify_with_parallel_config``). Nothing for a checkpoint without a record, one
    rank, or a malformed record (:func:`check_config` refuses that)."""
    from .tp import rank_heads

    size = getattr(parallel_config, "tensor_parallel_size", 1)
    try:
        record = record_of(getattr(model_config, "hf_config", None), getattr(model_config, "model", None))
    except IntegrationError:
        return
    if record is None or size <= 1:
        return
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    try:
        rank_heads(int(text.num_attention_heads), int(model_config.get_total_num_kv_heads()), size, 0)
    except IntegrationError as exc:
        raise ServeDeclined(f"{model_config.model}: attnzoo spec '{record['name']}': cannot be served with "
                            f"tensor_parallel_size {size}: {exc}") from None


def _serve_split(model_config, record: dict, user, size: int, where: str) -> None:
    """Tensor parallelism: each rank serves its own heads, their parameters sliced (``tp.py``); refused in one line
    where the spec cannot be split exactly (:func:`~.tp.split_refusal`)."""
    from .tp import split_refusal

    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    heads, kv_heads = int(text.num_attention_heads), int(model_config.get_total_num_kv_heads())
    try:
        budget = page_budget(record, model_config.max_model_len) if user.cache is not None else None
    except IntegrationError:  # a fraction of the prompt: _serve_pruned refuses it; the probe evicts to its own
        budget = model_config.max_model_len
    reason = split_refusal(user, heads, kv_heads, int(model_config.get_head_size()), size, budget)
    if reason:
        raise ServeDeclined(f"{where}: cannot be served with tensor_parallel_size {size}: {reason}")


def _serve_pruned(vllm_config, record: dict, where: str) -> None:
    """An evicting spec: each layer's cache is one page of budget + 1 tokens per request (``ring.py``). Refuse what
    would not reproduce a pruned history (no budget, a recompute after preemption in a hybrid model, speculative
    tokens, KV transfer); turn off what would change it (a prompt in chunks, prefix-cache hits), said once."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ServeDeclined(f"{where}: speculative decoding stores draft tokens before they are accepted, and an "
                            f"evicted token cannot be brought back: turn it off for a pruned checkpoint")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise ServeDeclined(f"{where}: a KV connector (kv_transfer_config) moves paged blocks; a pruned cache's "
                            f"page is not one: turn it off for a pruned checkpoint")
    if any(isinstance(b, float) for b in budgets(record)):
        raise ServeDeclined(f"{where}: budget {record['budget']} is a fraction of the prompt; vLLM needs a token "
                            f"budget: its page is sized at startup")
    model_config = vllm_config.model_config
    if getattr(model_config, "is_hybrid", False):
        raise ServeDeclined(f"{where}: a hybrid model (attention beside other layers' states) could be preempted and "
                            f"recomputed, which does not reproduce a pruned history")
    try:
        budget = page_budget(record, model_config.max_model_len)
    except IntegrationError as exc:  # a fraction of the prompt: one line, before any setting is changed
        raise ServeDeclined(f"{where}: {exc}") from None
    scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
    changed = []
    if cache.enable_prefix_caching:
        cache.enable_prefix_caching = False
        changed.append("prefix caching off (a pruned cache depends on the whole history)")
    _LOG.warning("attnzoo: %s: each layer keeps at most %s tokens per request in one page%s%s", where, budget,
                 " (a null budget: nothing evicted, every token of max_model_len kept with its scores)"
                 if None in budgets(record) else "", "; " + "; ".join(changed) if changed else "")
    chunked = scheduler.enable_chunked_prefill
    refusal = chunk_refusal(load_spec(record["spec"]))
    if chunked and refusal is None:
        _LOG.warning("attnzoo: %s", chunked_line(where, scheduler.max_num_batched_tokens,
                                                 model_config.max_model_len))
        return
    raised = scheduler.max_num_batched_tokens < model_config.max_model_len
    scheduler.enable_chunked_prefill = False
    scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, model_config.max_model_len)
    if chunked or raised:
        _LOG.warning("attnzoo: %s", whole_prompt_line(where, model_config.max_model_len, refusal))


def evictor_chunking() -> tuple[list[str], list[str]]:
    """The registered evictors (plugins' included) whose prompts are prefilled in chunks, and those prefilled whole
    (docs/vllm.md, "Chunked prefill"), as :func:`chunk_refusal` decides for a spec holding the evictor alone (an
    evictor that needs more, e.g. selective attention's accumulator, is prefilled whole)."""
    from ...registry import get_registry
    from ...spec import load_spec

    chunked, whole = [], []
    for kind in get_registry().evictors:
        try:
            spec = load_spec({"name": f"chunk-probe-{kind}", "cache": {"evictor": kind}})
        except Exception:  # noqa: BLE001 - an evictor that needs another transform: its spec decides, as a whole
            whole.append(kind)
            continue
        (chunked if chunk_refusal(spec) is None else whole).append(kind)
    return chunked, whole


def chunk_refusal(spec) -> str | None:
    """Why an evicting spec's prompts cannot be prefilled in chunks exactly, or None: its prefill's scoring reads
    every query's attention (an accumulator F or a probability map summed over the prompt's queries: selective
    attention; an evictor without ``probability_rows``: H2O) or per-token features of the queries. The others
    (sink_window, TOVA, SnapKV, KNorm, KeyDiff) score the whole prompt from its keys and at most its last
    ``probability_rows`` queries, staged until the last chunk (``layer.Layer._stage``)."""
    from ...nn import Attention
    from ...transforms.base import Slot

    try:
        core = Attention(spec, 2, 8, 1, backend="blocked")
        evictor = core.new_cache(1, budget=64).evictor
    except Exception as exc:  # noqa: BLE001 - any spec the probe cannot build stays on the whole-prompt step
        return f"its core could not be probed ({exc})"
    plan = core.variant.plan
    if plan.one(Slot.ACCUMULATOR) is not None or plan.one(Slot.PROBABILITY) is not None:
        return "its prefill accumulates every query's attention (selective attention's F)"
    if plan.composition.feature_transforms():
        return "its per-token features read every query of the prompt"
    if evictor is not None and evictor.needs_probabilities and evictor.probability_rows is None:
        return f"evictor '{evictor.kind}' scores the prompt by every query's attention"
    return None


def chunked_line(where: str, chunk: int, max_model_len: int) -> str:
    """The one line said at the start of an evicting spec's engine whose prompts are prefilled in chunks."""
    chunked, whole = evictor_chunking()
    return (f"{where}: chunked prefill served exactly (chunks of up to {chunk} tokens): a prompt's keys and values "
            f"are staged outside its page until its last chunk (2 * H_kv * D * dtype bytes per token and layer, up "
            f"to max_model_len {max_model_len} tokens), each chunk attending over the staged prompt, then evicted to "
            f"the budget as the whole prompt is (chunked: {', '.join(chunked)}; prefilled whole: "
            f"{', '.join(whole)})")


def whole_prompt_line(where: str, max_model_len: int, refusal: str | None = None) -> str:
    """The one line said at the start of an evicting spec's engine whose prompts are not prefilled in chunks
    (docs/vllm.md, "KV pruning"): ``refusal`` why (:func:`chunk_refusal`), or None (turned off by the user)."""
    chunked, whole = evictor_chunking() if refusal else ((), ())
    why = (f" ({refusal}; chunked prefill is served for {', '.join(chunked)}, not for "
           f"{', '.join(whole)})" if refusal else "")
    return (f"{where}: chunked prefill is not served for this evicting spec{why}: every prompt is prefilled whole in "
            f"one step, then evicted to the budget (max_num_batched_tokens raised to max_model_len {max_model_len}: "
            f"a step's activations grow with its prompt, up to {max_model_len} tokens, whatever the budget)")


#: why a model with chunked local attention layers is declined
CHUNKED_REASON = ("chunked local attention (attention_chunk_size {chunk}) is not served by attnzoo's vLLM backend "
                  "(vLLM runs those layers as per-chunk virtual batches, whose positions are not the tokens'); run it "
                  "with transformers (zt.apply)")


#: vLLM 0.32's models that build every attention layer alike (Qwen2Model): a window on some layers only is not served
ONE_WINDOW_MODELS = ("qwen2", "qwen3")


def mixed_windows(model_config) -> str | None:
    """Why vLLM would not give each layer the window the checkpoint's config gives it, or None: a Qwen2/Qwen3
    config whose ``layer_types`` mixes sliding and full attention (``max_window_layers``): vLLM 0.32's model asserts
    in a worker, or runs every layer alike."""
    text = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    kinds = list(getattr(text, "layer_types", None) or [])
    if getattr(text, "model_type", None) not in ONE_WINDOW_MODELS or len(set(kinds)) < 2:
        return None
    sliding = [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]
    return (f"layers {sliding[0]}..{sliding[-1]} of {len(kinds)} have a sliding window and the others not "
            f"(layer_types / max_window_layers); vLLM 0.32's {text.model_type} model gives every layer the same "
            f"attention (it asserts, or serves no window): run it with transformers (zt.apply)")


def chunk_size(model_config) -> int | None:
    """The model's ``attention_chunk_size`` (Llama 4's chunked local attention layers), or None."""
    text = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    chunk = getattr(text, "attention_chunk_size", None)
    return chunk if isinstance(chunk, int) and chunk > 0 else None


def budgets(record: dict) -> list:
    """The recorded budgets, one per layer or one for all (None: no eviction)."""
    budget = record["budget"]
    return list(budget) if isinstance(budget, list) else [budget]


def page_budget(record: dict, max_model_len: int) -> int:
    """The tokens a page holds: the largest recorded budget (one page size for every layer; a layer with a smaller
    budget uses fewer slots), or ``max_model_len`` where a layer's budget is null (it never evicts; the page keeps
    its tokens with their per-token scores, e.g. selective attention's F). A fraction of the prompt (a float budget)
    is refused in one line (an :class:`~attnzoo.integrations.transformers.base.IntegrationError`): the page is sized
    once, at engine start, and each request would resolve its own budget at its prefill."""
    found = budgets(record)
    fractions = [b for b in found if isinstance(b, float)]
    if fractions:
        raise IntegrationError(f"budget {fractions[0]} is a fraction of the prompt, which attnzoo's vLLM backend does "
                               f"not serve (a request's page is sized once, at engine start): save the checkpoint "
                               f"with a token budget (zt.apply(model, spec, budget=<tokens>))")
    return max_model_len if None in found else max(found)
