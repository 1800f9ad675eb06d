"""Quality per kept fraction on a real model (issue 52, item 1): what KV eviction costs SmolLM2-135M-Instruct.

On the real model (``zt.smollm2()``, float32, CPU), for the full cache (the ceiling) and every evicting spec the
registry holds (every registered spec with a ``cache:`` evictor, discovered at run time; specs that differ only in
their default budget, such as ``selective`` and ``selective-pruned``, run once), at kept fractions of the prompt
(default 12.5 / 25 / 50 %; the budget is ``round(fraction * prompt tokens)`` tokens per layer, per KV head):

- **passkey retrieval**: a random 5-digit pass key (seeded) planted at a depth (default 10 / 50 / 90 %) of real
  filler text (the corpus attnzoo ships, ``attnzoo/experiments/data/python-docs.txt.gz``), the question last, all
  inside the one prompt that is compressed at prefill; greedy generation through the compressed cache; exact match
  of the first number in the answer; at each context length (default 1k and 2k tokens; 4k with ``--contexts``);
- **long-text perplexity**: a prefix (default 768 tokens) compressed at prefill, then the continuation (default 256
  tokens) teacher-forced **token by token** through the compressed cache, so decode-time evictors keep evicting
  while the continuation is scored (the full cache scores the same tokens in one forward: the same numbers).

Every cache here is float32, attnzoo's and the full one alike, so the fraction of bytes held relative to a full
cache of the same dtype (and to a bfloat16 full cache for a bfloat16 cache) is the fraction of tokens kept: the
x-axis. The measured bytes held (``AttnzooCache.nbytes`` at the end of each case: after the answer's tokens, and
for a ``/prefill`` method, whose cache grows, after the continuation too) are reported too.

kvpress (a peer; it pins an older transformers) runs live with ``--kvpress-python PYTHON``, an interpreter that can
import torch, an older transformers and kvpress (``--kvpress-path DIR`` puts a folder first on its ``sys.path``: an
older transformers installed with ``--target``; ``--kvpress-side DIR`` one last: kvpress itself): this file runs
itself there as a worker on the same token ids (``--kvpress-worker``), which reports JSON lines. Each press
compresses the prompt at prefill and nothing after (kvpress's presses do not run at decode). Without it, kvpress's
figures are those last recorded in issue 52, labelled as not measured in this run.

    .venv/bin/python benchmarks/quality.py                    # default: 1k and 2k, 3 depths, 2 cases per cell
    .venv/bin/python benchmarks/quality.py --contexts 1024 2048 4096 --cases 20     # the issue's full size
    make bench-quality                                        # the committed run (docs/quality.md)

Outputs: ``<out>/<name>.json`` and ``.md`` (default ``benchmarks/results/quality``) and the plot (default
``docs/images/quality.png``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "attnzoo" / "experiments" / "data" / "python-docs.txt.gz"
INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the pass key.\n\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_PREFIX = "The pass key is"
MARK = "@@PASSKEY-MESSAGE@@"

BYTES_RULE = (
    "fraction = bytes held / a bfloat16 full cache's bytes for the prompt (keys and values, 2 bytes an element). "
    "Each attnzoo method keeps the tokens that fit (token_bytes(): keys and values at bfloat16 or at kv_bits with a "
    "float16 scale and zero point per token and head, plus its int64 position and float32 per-token scores); "
    "kvpress's presses keep fraction x prompt tokens (a bfloat16 DynamicCache holds keys and values only), or with "
    "--kvpress-bits the tokens whose keys and values fit those bytes in transformers' quanto QuantizedCache. The "
    "model computes in float32; unquantized caches are counted at bfloat16, as served ('held' below: measured "
    "cache.nbytes so counted, over the bfloat16 full cache's bytes).")

#: kvpress's figures last recorded in issue 52 (SmolLM2-135M-Instruct, passkey at 1k tokens, 12 cases, question
#: inside the compressed prompt; perplexity 768 compressed + 256 teacher-forced). Not measured by this script.
KVPRESS_RECORDED = {
    "source": "issue 52 (last recorded; not measured in this run)",
    "passkey_1k_of_12": {
        "KeyDiffPress": {0.125: 4, 0.25: 7, 0.5: 11},
        "SnapKVPress": {0.125: 0, 0.25: 0, 0.5: 8},
        "ExpectedAttentionPress": {0.125: 0, 0.25: 0, 0.5: 2},
        "KnormPress": {0.125: 0, 0.25: 0, 0.5: 3},
    },
    "passkey_1k_full_of_12": 12,
    "ppl_best": {"ExpectedAttentionPress": {0.125: 11.70, 0.25: 11.17}},
    "ppl_full": 10.66,
}
KVPRESS_PRESSES = ["KnormPress", "SnapKVPress", "ExpectedAttentionPress", "KeyDiffPress", "StreamingLLMPress",
                   "TOVAPress"]


# -- inputs (no attnzoo, no kvpress: the worker shares these) --------------------------------------------------------
def corpus_text() -> str:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        return f.read()


def template_parts(tokenizer) -> tuple[list[int], list[int]]:
    """Token ids before and after the user's message in the chat template, the assistant's turn opened and the
    answer's first words written (the question stays last, inside the prompt that is compressed)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=True,
                                         tokenize=False)
    before, after = text.split(MARK)
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    return enc(before), enc(after + ANSWER_PREFIX)


def filler(tokenizer, text: str, rng: random.Random, count: int) -> list[int]:
    """``count`` token ids of real text from a random place in the corpus (starting at a line)."""
    need = count * 6 + 2000
    start = rng.randrange(0, max(1, len(text) - need))
    start = text.find("\n", start) + 1
    ids = tokenizer(text[start:start + need], add_special_tokens=False).input_ids
    if len(ids) < count:
        raise ValueError(f"the corpus slice gave {len(ids)} tokens, {count} wanted")
    return ids[:count]


def passkey_cases(tokenizer, contexts, depths, cases: int, seed: int) -> list[dict]:
    """Each case: prompt ids of exactly ``context`` tokens, the key at ``depth`` of the filler (moved to the
    nearest sentence or line end within 48 tokens)."""
    text = corpus_text()
    head, tail = template_parts(tokenizer)
    intro = tokenizer(INTRO, add_special_tokens=False).input_ids
    question = tokenizer(QUESTION, add_special_tokens=False).input_ids
    rng = random.Random(seed)
    out = []
    for context in contexts:
        for depth in depths:
            for i in range(cases):
                key = rng.randrange(10000, 100000)
                needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids
                fixed = len(head) + len(intro) + len(needle) + len(question) + len(tail)
                ids = filler(tokenizer, text, rng, context - fixed)
                at = round(depth * len(ids))
                ends = [j for j in range(max(1, at - 48), min(len(ids), at + 49))
                        if tokenizer.decode(ids[j - 1:j]).rstrip(" ").endswith((".", "\n"))]
                if ends:
                    at = min(ends, key=lambda j: abs(j - at))
                prompt = head + intro + ids[:at] + needle + ids[at:] + question + tail
                assert len(prompt) == context, (len(prompt), context)
                out.append({"context": context, "depth": depth, "case": i, "key": key, "ids": prompt,
                            "needle_at": len(head) + len(intro) + at})
    return out


def ppl_docs(tokenizer, count: int, prefix: int, continuation: int, seed: int) -> list[dict]:
    text = corpus_text()
    rng = random.Random(seed + 1)
    return [{"doc": i, "ids": filler(tokenizer, text, rng, prefix + continuation)} for i in range(count)]


def answer_matches(answer: str, key: int) -> bool:
    found = re.search(r"\d+", answer)
    return found is not None and found.group(0) == str(key)


# -- the kvpress worker (runs in the side interpreter: torch, its transformers and kvpress only) --------------------
def kvpress_worker(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    for extra in reversed(job.get("path", [])):  # an older transformers, before the environment's own
        sys.path.insert(0, extra)
    sys.path.extend(job.get("side", []))  # kvpress and what it imports, after the environment's own
    import kvpress
    import torch
    import transformers

    torch.manual_seed(0)
    try:
        model = transformers.LlamaForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                              local_files_only=True).eval()
    except TypeError:  # transformers 4 names it torch_dtype
        model = transformers.LlamaForCausalLM.from_pretrained(job["model"], torch_dtype=torch.float32,
                                                              local_files_only=True).eval()
    say = lambda obj: print(json.dumps(obj), flush=True)  # noqa: E731
    from importlib.metadata import version

    say({"versions": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                      "torch": torch.__version__}})
    bits = job.get("bits")
    kept = 1.0  # prompt tokens a press keeps per unit of bytes fraction: 1 in bfloat16, more in `bits`
    if bits:
        per_token = quantized_token_bytes(transformers, model.config, bits)
        kept = 2 * model.config.head_dim * 2 / per_token  # a bfloat16 token's keys and values / a quantized one's
        say({"quantized": {"bits": bits, "bytes_per_token_head": per_token, "tokens_per_bf16_token": kept}})
    label = f"@{bits}" if bits else ""
    for name in job["presses"]:
        for fraction in job["fractions"]:
            ratio = max(0.0, 1 - fraction * kept)  # the bytes of `fraction` of a bfloat16 full cache
            try:
                press = build_press(kvpress, name, ratio)
            except Exception as exc:  # noqa: BLE001 - a press this kvpress lacks or builds otherwise
                say({"press": name + label, "fraction": fraction, "error": f"{type(exc).__name__}: {exc}"})
                continue
            for case in job["cases"]:
                ids = torch.tensor([case["ids"]])
                extra = {}
                if bits:  # kvpress pairs a press with transformers' quantized cache (quanto, per-group scales)
                    extra["past_key_values"] = transformers.QuantizedCache(backend="quanto", config=model.config,
                                                                           nbits=bits)
                try:
                    with torch.no_grad(), press(model):
                        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                             max_new_tokens=job["max_new_tokens"], do_sample=False,
                                             pad_token_id=job["eos"], eos_token_id=job["eos"], **extra)
                    held = quantized_cache_bytes(extra["past_key_values"]) if bits else None
                    say({"press": name + label, "fraction": fraction, "kind": "passkey", "case": case["index"],
                         "tokens": out[0, ids.shape[1]:].tolist(), "held_bytes": held})
                except Exception as exc:  # noqa: BLE001 - reported, not hidden
                    say({"press": name + label, "fraction": fraction, "kind": "passkey", "case": case["index"],
                         "error": f"{type(exc).__name__}: {exc}"})
            for doc in job["docs"]:
                ids = torch.tensor([doc["ids"]])
                prefix = job["prefix"]
                try:
                    nll = 0.0
                    extra = {}
                    if bits:
                        extra["past_key_values"] = transformers.QuantizedCache(backend="quanto", config=model.config,
                                                                               nbits=bits)
                    with torch.no_grad():
                        with press(model):
                            out = model(ids[:, :prefix], use_cache=True, **extra)
                        cache = out.past_key_values
                        logits = out.logits[:, -1]
                        for t in range(prefix, ids.shape[1]):
                            nll -= torch.log_softmax(logits.float(), -1)[0, ids[0, t]].item()
                            if t + 1 < ids.shape[1]:
                                # positions given: the compressed cache's length is not the tokens seen, which
                                # transformers would number the next token from (generate() numbers them itself)
                                out = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True,
                                            cache_position=torch.tensor([t]), position_ids=torch.tensor([[t]]))
                                cache, logits = out.past_key_values, out.logits[:, -1]
                    say({"press": name + label, "fraction": fraction, "kind": "ppl", "doc": doc["doc"], "nll": nll,
                         "tokens": ids.shape[1] - prefix})
                except Exception as exc:  # noqa: BLE001
                    say({"press": name + label, "fraction": fraction, "kind": "ppl", "doc": doc["doc"],
                         "error": f"{type(exc).__name__}: {exc}"})


def build_press(kvpress, name: str, ratio: float):
    """A kvpress press by name at ``compression_ratio`` ``ratio``; ``Wrapper:Inner`` (``AdaKVPress:SnapKVPress``,
    ``MergingPress:KeyDiffPress``) wraps the scorer press ``Inner`` in ``Wrapper``."""
    outer, _, inner = name.partition(":")
    if not inner:
        return getattr(kvpress, outer)(compression_ratio=ratio)
    return getattr(kvpress, outer)(press=getattr(kvpress, inner)(compression_ratio=ratio))


def tensor_bytes(t) -> int:
    """Bytes of a tensor as a server holds it: floating elements at 2 bytes (bfloat16; the benchmark computes in
    float32), integer codes as they are; a tensor subclass (quanto's packed codes, scales and shifts) by its parts."""
    if hasattr(t, "__tensor_flatten__") and type(t).__name__ != "Tensor":
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * (2 if t.is_floating_point() else t.element_size())


def quantized_cache_bytes(cache) -> int:
    """Bytes a transformers QuantizedCache holds: every layer's quantized keys and values and its full-precision
    residual (the newest tokens, below ``residual_length``), counted by :func:`tensor_bytes`."""
    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and hasattr(t, "numel") and t.numel():
                total += tensor_bytes(t)
    return total


def quantized_token_bytes(transformers, config, bits: int) -> float:
    """Bytes one token holds per key/value head in transformers' quanto QuantizedCache at ``bits`` (keys and values,
    codes with their per-group scales and shifts), measured on 512 random tokens."""
    import torch

    cache = transformers.QuantizedCache(backend="quanto", config=config, nbits=bits)
    layer = cache.layers[0]
    rows = torch.randn(1, 1, 512, config.head_dim)
    return (tensor_bytes(layer._quantize(rows, axis=layer.axis_key))
            + tensor_bytes(layer._quantize(rows, axis=layer.axis_value))) / 512


def run_kvpress(args, model_folder, cases, docs, tokenizer, progress, full_per_token: int) -> dict:
    """kvpress's presses in the side interpreter on the same ids, once per ``--kvpress-bits`` (a bfloat16
    DynamicCache, or transformers' quanto QuantizedCache at those bits); their rows, or an error line."""
    merged: dict = {"passkey": {}, "ppl": {}, "errors": [], "held": {}, "quantized": []}
    for bits in args.kvpress_bits:
        live = run_kvpress_once(args, model_folder, cases, docs, tokenizer, progress, bits, full_per_token)
        if "error" in live:
            return live
        merged["versions"] = live["versions"]
        for key in ("passkey", "ppl", "held"):
            merged[key].update(live[key])
        merged["errors"] += live["errors"]
        if live["quantized"]:
            merged["quantized"].append(live["quantized"])
    merged["errors"] = merged["errors"][:20]
    return merged


def run_kvpress_once(args, model_folder, cases, docs, tokenizer, progress, bits, full_per_token) -> dict:
    presses = args.kvpress_presses
    job = {"model": str(model_folder), "presses": presses, "fractions": args.fractions,
           "cases": [{"index": i, "ids": c["ids"]} for i, c in enumerate(cases)],
           "docs": docs, "prefix": args.ppl_prefix, "max_new_tokens": args.max_new_tokens,
           "eos": tokenizer.eos_token_id, "path": args.kvpress_path, "side": args.kvpress_side, "bits": bits}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        log = open(Path(tmp) / "stderr.txt", "w+")  # noqa: SIM115 - read back below
        proc = subprocess.Popen([args.kvpress_python, str(Path(__file__).resolve()), "--kvpress-worker", str(path)],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        rows = []
        for line in proc.stdout:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
            if "press" in rows[-1]:
                progress.update(1)
        proc.wait()
        log.seek(0)
        err = log.read()
        log.close()
    versions = next((r["versions"] for r in rows if "versions" in r), None)
    if proc.returncode or versions is None:
        return {"error": (err.strip().splitlines() or ["no output"])[-1], "returncode": proc.returncode}
    quantized = next((r["quantized"] for r in rows if "quantized" in r), None)
    passkey, ppl, errors, ratios = {}, {}, [], {}
    for r in rows:
        if "error" in r:
            errors.append(f"{r['press']} at {r['fraction']}: {r['error']}")
            continue
        if r.get("kind") == "passkey":
            case = cases[r["case"]]
            answer = tokenizer.decode(r["tokens"], skip_special_tokens=True).strip()
            method = f"kvpress {r['press']}"
            passkey.setdefault(method, []).append(
                {"fraction": r["fraction"], "context": case["context"], "depth": case["depth"], "case": case["case"],
                 "key": case["key"], "answer": answer, "correct": answer_matches(answer, case["key"])})
            if r.get("held_bytes") is not None:  # measured after generation: the prompt's and the answer's tokens
                full = len(case["ids"]) * full_per_token  # a bfloat16 full cache of the prompt, every layer
                ratios.setdefault(method, {}).setdefault(str(r["fraction"]), []).append(r["held_bytes"] / full)
        elif r.get("kind") == "ppl":
            ppl.setdefault(f"kvpress {r['press']}", []).append(
                {"fraction": r["fraction"], "doc": r["doc"], "nll": r["nll"], "tokens": r["tokens"]})
    held = {m: {f: sum(v) / len(v) for f, v in by.items()} for m, by in ratios.items()}
    return {"versions": versions, "passkey": passkey, "ppl": ppl, "errors": errors[:20], "held": held,
            "quantized": quantized}


# -- attnzoo --------------------------------------------------------------------------------------------------------
def evicting_specs(only: list[str] | None, exclude=()) -> tuple[list[str], dict[str, str]]:
    """Every registered spec with a cache evictor, one per distinct spec (budget aside): (names, aliases)."""
    from attnzoo.registry import get_registry

    specs = get_registry().specs
    if only is not None:  # given (an empty list: the full cache only)
        missing = [n for n in only if n not in specs]
        if missing:
            raise SystemExit(f"unknown spec(s): {', '.join(missing)}; registered: {', '.join(sorted(specs))}")
        return list(only), {}
    seen: dict[str, str] = {}
    aliases: dict[str, str] = {}
    # names with a default budget first, so that 'selective-pruned' stands for 'selective'
    for name in sorted(specs, key=lambda n: (specs[n].cache is None or specs[n].cache.budget is None, n)):
        spec = specs[name]
        if spec.cache is None:
            continue
        data = spec.function()
        data["cache"] = {k: v for k, v in (data.get("cache") or {}).items() if k != "budget"}
        key = json.dumps(data, sort_keys=True)
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
    return sorted(n for n in seen.values() if n not in exclude), aliases


def budget_of(fraction: float, length: int) -> int:
    return max(1, round(fraction * length))


def split_method(method: str) -> tuple[str, int | None]:
    """'snapkv' -> ('snapkv', None); 'snapkv@8' -> ('snapkv', 8); 'snapkv@4u+pyramid' -> ('snapkv', 4): a spec, and
    the bits its cache holds keys and values in (``AttnzooCache(kv_bits=...)``), None for the model's dtype."""
    name, _, bits = method.partition("/")[0].partition("+")[0].partition("@")
    return name, (int(bits.partition("r")[0].rstrip("u")) if bits else None)


def recent_of(method: str) -> int:
    """The newest tokens a method's cache holds at full precision beside their codes: 'snapkv@4r64' -> 64
    (``AttnzooCache(kv_recent=64)``), 0 without an ``r`` suffix on its bits."""
    bits = method.partition("/")[0].partition("+")[0].partition("@")[2]
    return int(bits.partition("r")[2] or 0)


def layer_shape(method: str) -> str:
    """How a method spreads its budget over the layers: 'flat' (every layer the same), or 'pyramid' for a name
    with the ``+pyramid`` suffix (``zt.layer_budgets``: more in early layers, less in late ones, the same total)."""
    return "pyramid" if method.partition("/")[0].endswith("+pyramid") else "flat"


def cache_options(method: str) -> dict:
    """``AttnzooCache`` options of a method: ``spec@8`` / ``spec@4`` quantized in Hadamard-rotated coordinates (the
    cache's default), ``spec@8u`` / ``spec@4u`` unrotated (``kv_rotate=False``); a ``/prefill`` suffix: the prompt
    compressed at prefill and every later token kept (``evict="prefill"``, kvpress's way)."""
    base, _, mode = method.partition("/")
    base = base.partition("+")[0]
    _, bits = split_method(base)
    options = {"evict": "prefill"} if mode == "prefill" else {}
    if bits is None:
        return options
    recent = recent_of(base)
    return {**options, "kv_bits": bits, **({"kv_rotate": False} if base.partition("r")[0].endswith("u") else {}),
            **({"kv_recent": recent} if recent else {})}


KV_BITS = ("8", "4", "3", "2", "8u", "4u", "3u", "2u")


def kv_bits_choice(value: str):
    """--kv-bits values: none, 8, 4, 3, 2, and 8u, 4u, 3u, 2u (unrotated), each optionally with ``rN`` (4r64, 4ur64:
    the newest N tokens at full precision as well, ``AttnzooCache(kv_recent=N)``)."""
    if value == "none":
        return None
    bits, _, recent = value.partition("r")
    if bits not in KV_BITS or (value.count("r") and not recent.isdigit()):
        raise argparse.ArgumentTypeError(f"--kv-bits takes none, {', '.join(KV_BITS)} (each optionally with rN: "
                                         f"4r64), got {value!r}")
    return value


def token_bytes(config, spec_name: str | None, kv_bits: int | None) -> int:
    """Bytes one token holds per layer, summed over the key/value heads, counted as a server holds them: keys and
    values in bfloat16 (2 bytes an element) unless quantized (``kv_bits`` codes an element, plus a float16 scale and
    zero point per token, head and tensor), and for an attnzoo cache its int64 position and float32 per-token scores
    (its evictor's ``state_names``) per head. ``spec_name`` None: a plain full cache (keys and values only)."""
    heads, d = config.num_key_value_heads, config.head_dim
    if kv_bits is None:
        kv = 2 * d * 2
    else:
        kv = 2 * (math.ceil(d * kv_bits / 8) + 4)
    extra = 0
    if spec_name is not None:
        import attnzoo
        from attnzoo.registry import get_registry

        variant = attnzoo.compile(get_registry().specs[spec_name])
        extra = 8 + 4 * len(variant.new_cache(batch=1).state_names)
    return heads * (kv + extra)


def byte_budget(fraction: float, length: int, config, spec_name: str, kv_bits: int | None, recent: int = 0) -> int:
    """Tokens a cache keeps to hold ``fraction`` of a bfloat16 full cache's bytes for a prompt of ``length``; its
    ``recent`` newest tokens' rows at bfloat16 beside their codes (``kv_recent``) come out of those bytes first."""
    full = length * token_bytes(config, None, None)
    exact = recent * token_bytes(config, None, None)  # their keys and values at bfloat16, every head
    return max(2, int((fraction * full - exact) // token_bytes(config, spec_name, kv_bits)))


def full_kv_bytes(model, length: int) -> int:
    """A bfloat16 full cache's keys and values for ``length`` tokens, every layer."""
    c = model.config
    return c.num_hidden_layers * length * token_bytes(c, None, None)


def counted_bytes(model, cache, spec_name: str, kv_bits: int | None) -> int:
    """``cache.nbytes`` (measured) with unquantized keys and values counted at bfloat16 (the benchmark computes in
    float32; a server holds bfloat16): what :func:`token_bytes` predicts, checked against the cache itself."""
    held = cache.nbytes
    for kv in cache.kv_caches:
        if kv is None or kv.keys is None:
            continue
        if kv_bits is None:
            rows = (kv.keys, kv.values)
        else:  # the newest tokens' exact rows beside their codes (kv_recent)
            packed = kv.__dict__.get("_packed")
            rows = () if packed is None or packed.exact is None else packed.exact[1:]
        for t in rows:
            held -= t.numel() * (t.element_size() - 2)
    return held


def run_passkey(model, tokenizer, case, cache, max_new_tokens) -> tuple[str, int | None]:
    import torch

    ids = torch.tensor([case["ids"]])
    extra = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id,
                             eos_token_id=tokenizer.eos_token_id, **extra)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return answer, None if cache is None else cache.nbytes


def run_ppl(model, doc, prefix, cache) -> tuple[float, int, int | None]:
    """Summed NLL of the continuation: the full cache in one forward; a compressed one token by token."""
    import torch

    ids = torch.tensor([doc["ids"]])
    with torch.no_grad():
        if cache is None:
            logits = model(ids, use_cache=False).logits[0, prefix - 1:-1]
            nll = torch.nn.functional.cross_entropy(logits.float(), ids[0, prefix:], reduction="sum").item()
            return nll, ids.shape[1] - prefix, None
        out = model(ids[:, :prefix], cache=cache, use_cache=True, logits_to_keep=1)
        held = cache.nbytes
        nll, logits = 0.0, out.logits[0, -1]
        for t in range(prefix, ids.shape[1]):
            nll -= torch.log_softmax(logits.float(), -1)[ids[0, t]].item()
            if t + 1 < ids.shape[1]:
                logits = model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1]
    return nll, ids.shape[1] - prefix, held


# -- report ---------------------------------------------------------------------------------------------------------
def pct(x: float) -> str:
    return f"{100 * x:g}%"


def summarise(result: dict) -> dict:
    """Per method, fraction and context: correct / total; per method and fraction: perplexity."""
    table: dict = {}
    for method, rows in result["passkey"].items():
        for r in rows:
            cell = table.setdefault(method, {}).setdefault(str(r["fraction"]), {}).setdefault(
                str(r["context"]), {"correct": 0, "total": 0, "by_depth": {}})
            cell["correct"] += r["correct"]
            cell["total"] += 1
            d = cell["by_depth"].setdefault(str(r["depth"]), [0, 0])
            d[0] += r["correct"]
            d[1] += 1
    ppl: dict = {}
    for method, rows in result["ppl"].items():
        for r in rows:
            cell = ppl.setdefault(method, {}).setdefault(str(r["fraction"]), {"nll": 0.0, "tokens": 0})
            cell["nll"] += r["nll"]
            cell["tokens"] += r["tokens"]
    for method in ppl:
        for cell in ppl[method].values():
            cell["ppl"] = math.exp(cell["nll"] / cell["tokens"])
    return {"passkey": table, "ppl": ppl}


def measured_contexts(result: dict) -> list[int]:
    """The contexts whose passkey cases ran (none with ``--cases 0``: a perplexity-only run)."""
    full = result["summary"]["passkey"].get("full", {}).get("1.0", {})
    return [c for c in result["config"]["contexts"] if str(c) in full]


def to_markdown(result: dict) -> str:
    cfg, meta, summary = result["config"], result["meta"], result["summary"]
    fr = cfg["fractions"]
    lines = [
        "# Quality per kept fraction: SmolLM2-135M-Instruct (issue 52)", "",
        f"`{meta['command']}` on {meta['cpu']} ({meta['threads']} threads), torch {meta['torch']}, transformers "
        f"{meta['transformers']}; float32; {meta['wall_s']:.0f} s in all ({meta['wall_s'] / 60:.1f} min). "
        f"Seed {cfg['seed']}.", "",
    ]
    if not meta.get("complete", True):
        lines += ["**A partial run** (interrupted, or still running): the methods below only.", ""]
    lines += [
        f"**Passkey**: {cfg['cases']} cases per cell (context x depth), depths "
        f"{', '.join(pct(d) for d in cfg['depths'])}, so {cfg['cases'] * len(cfg['depths'])} per context; the "
        f"question last, inside the prompt that is compressed at prefill; greedy, {cfg['max_new_tokens']} new tokens "
        f"at most; exact match of the number. Columns: {cfg.get('bytes', '')} Budgets per layer and KV head; "
        f"`spec@8` / `spec@4` / `spec@3` / `spec@2`: keys and values held in that many bits, quantized in "
        f"Hadamard-rotated coordinates (the cache's default); `spec@8u`, `spec@4u`, ...: unrotated "
        f"(`kv_rotate=False`).",
        "",
    ]
    methods = list(summary["passkey"])
    unit = "of the bytes" if cfg.get("axis", "tokens") == "bytes" else "kept"
    for context in measured_contexts(result):
        lines += [f"### Passkey at {context} tokens (correct / cases)", "",
                  "| method | " + " | ".join(f"{pct(f)} {unit}" for f in fr) + " | full cache |",
                  "|---|" + "---|" * (len(fr) + 1)]
        for m in methods:
            cells = summary["passkey"][m]
            if m == "full":
                c = cells["1.0"][str(context)]
                lines.append("| full cache | " + " | ".join("" for _ in fr) + f" | {c['correct']} / {c['total']} |")
                continue
            row = []
            for f in fr:
                c = cells.get(str(f), {}).get(str(context))
                row.append("" if c is None else f"{c['correct']} / {c['total']}")
            lines.append(f"| {m} | " + " | ".join(row) + " | |")
        lines.append("")
    lines += ["### Passkey by depth (correct / cases, all contexts together)", "",
              "| method | kept | " + " | ".join(f"depth {pct(d)}" for d in cfg["depths"]) + " |",
              "|---|---|" + "---|" * len(cfg["depths"])]
    for m in methods:
        for f, cells in summary["passkey"][m].items():
            sums = {str(d): [0, 0] for d in cfg["depths"]}
            for c in cells.values():
                for d, (k, n) in c["by_depth"].items():
                    sums[d][0] += k
                    sums[d][1] += n
            kept = "100%" if m == "full" else pct(float(f))
            lines.append(f"| {m} | {kept} | " + " | ".join(f"{k} / {n}" for k, n in sums.values()) + " |")
    lines.append("")
    p = cfg["ppl"]
    lines += [f"### Perplexity ({p['docs']} text(s) of the corpus: {p['prefix']} tokens compressed at prefill, "
              f"{p['continuation']} teacher-forced token by token through the compressed cache, decode-time "
              f"eviction on)", ""]
    if any(m.endswith("/prefill") for m in summary["ppl"]):
        lines += ["`/prefill` rows: the prefix compressed at prefill (`AttnzooCache(evict=\"prefill\")`), the "
                  "continuation fed token by token and every token of it kept, as kvpress's rows: their cache "
                  "grows by the continuation; the fraction is that of the compressed prefix.", ""]
    if any(m.startswith("kvpress") for m in summary["ppl"]):
        lines += ["kvpress rows: the prefix compressed at prefill, the continuation fed token by token with no "
                  "eviction (kvpress's presses do not run at decode): their cache grows by the continuation.", ""]
    lines += ["| method | " + " | ".join(f"{pct(f)} {unit}" for f in fr) + " | full cache |",
              "|---|" + "---|" * (len(fr) + 1)]
    for m, cells in summary["ppl"].items():
        if m == "full":
            lines.append("| full cache | " + " | ".join("" for _ in fr) + f" | {cells['1.0']['ppl']:.2f} |")
        else:
            lines.append(f"| {m} | " + " | ".join(
                f"{cells[str(f)]['ppl']:.2f}" if str(f) in cells else "" for f in fr) + " | |")
    lines.append("")
    if result.get("held"):
        lines += ["Bytes held (measured `cache.nbytes` at the end of each case, unquantized keys and values counted "
                  "at bfloat16; a `/prefill` method's cache has grown by the answer or the continuation, as kvpress's "
                  "has) / a bfloat16 full cache's for the prompt, mean over cases:", "",
                  "| method | " + " | ".join(f"{pct(f)} {unit}" for f in fr) + " |", "|---|" + "---|" * len(fr)]
        for m, cells in result["held"].items():
            lines.append(f"| {m} | " + " | ".join(
                f"{cells[str(f)]:.3f}" if str(f) in cells else "" for f in fr) + " |")
        lines.append("")
    kv = result["kvpress"]
    if kv.get("live"):
        quantized = "".join(
            f" `@{q['bits']}` rows: transformers' quanto QuantizedCache at {q['bits']} bits "
            f"({q['bytes_per_token_head']:.1f} bytes a token and key/value head, scales counted at 2 bytes), each "
            f"press keeping {q['tokens_per_bf16_token']:.2f}x the tokens of the bfloat16 row at the same bytes."
            for q in kv["live"].get("quantized") or [])
        lines += [f"kvpress ran live in this run ({kv['live'].get('versions')}); its rows are above.{quantized} "
                  + (f"Errors: {'; '.join(kv['live']['errors'])}" if kv["live"].get("errors") else ""), ""]
    else:
        rec = KVPRESS_RECORDED
        why = kv.get("why", "no --kvpress-python given")
        lines += [f"### kvpress: last recorded (issue 52), **not measured in this run** ({why})", "",
                  "Passkey at 1k tokens, 12 cases (full cache 12 / 12), the question inside the compressed prompt; "
                  "another case set and prompt than the rows above, so compare with care:", "",
                  "| press | " + " | ".join(f"{pct(f)} kept" for f in fr) + " |", "|---|" + "---|" * len(fr)]
        for press, cells in rec["passkey_1k_of_12"].items():
            lines.append(f"| kvpress {press} (issue 52) | " + " | ".join(
                f"{cells[f]} / 12" if f in cells else "" for f in fr) + " |")
        lines += ["", f"Perplexity (768 compressed + 256 teacher-forced; full {rec['ppl_full']}): kvpress's best, "
                  f"ExpectedAttentionPress, {rec['ppl_best']['ExpectedAttentionPress'][0.125]} at 12.5% and "
                  f"{rec['ppl_best']['ExpectedAttentionPress'][0.25]} at 25% (issue 52).", ""]
    lines += ["Timings (s, whole method at all fractions): " + ", ".join(
        f"{m} {t:.0f}" for m, t in meta["method_seconds"].items()), ""]
    if result.get("aliases"):
        lines += ["Not run separately (the same spec but for the default budget): " + ", ".join(
            f"{a} = {b}" for a, b in result["aliases"].items()), ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, summary = result["config"], result["summary"]
    contexts = measured_contexts(result)
    xlabel = ("% of a bfloat16 full cache's bytes" if cfg.get("axis", "tokens") == "bytes"
              else "kept % of the prompt's tokens")
    has_ppl = "full" in summary["ppl"]
    panels = len(contexts) + has_ppl
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    methods = [m for m in summary["passkey"] if m != "full"]
    scored = [m for m in summary["ppl"] if m != "full"]  # a perplexity-only run's methods too
    everyone = methods + [m for m in scored if m not in methods]
    palette = [f"C{i}" for i in range(10)] if len(everyone) <= 10 else \
        [plt.cm.tab20(j) for j in (*range(0, 20, 2), *range(1, 20, 2))]  # 20 distinct: dark ones first
    colors = {m: palette[i % len(palette)] for i, m in enumerate(everyone)}
    style = lambda m: "s--" if m.startswith("kvpress") else "o-"  # noqa: E731
    for ax, context in zip(axes, contexts, strict=False):
        full = summary["passkey"]["full"]["1.0"][str(context)]
        ax.axhline(100 * full["correct"] / full["total"], color="black", ls="--", lw=1, label="full cache")
        for m in methods:
            cells = summary["passkey"][m]
            xs = [f for f in cfg["fractions"] if str(context) in cells.get(str(f), {})]
            ys = [100 * cells[str(f)][str(context)]["correct"] / cells[str(f)][str(context)]["total"] for f in xs]
            ax.plot([100 * x for x in xs], ys, style(m), color=colors[m], label=m)
        if context == 1024 and not result["kvpress"].get("live"):
            for i, (press, cells) in enumerate(KVPRESS_RECORDED["passkey_1k_of_12"].items()):
                xs = sorted(cells)
                ax.plot([100 * x for x in xs], [100 * cells[x] / 12 for x in xs], ":", marker="x", color="0.5",
                        alpha=0.5 + 0.12 * i, label=f"kvpress {press.replace('Press', '')} (issue 52, not this run)")
        n = full["total"]
        ax.set(title=f"passkey at {context} tokens ({n} cases)", xlabel=xlabel,
               ylabel="exact match %", xscale="log", ylim=(-3, 103))
        ax.set_xticks([100 * f for f in cfg["fractions"]], [f"{100 * f:g}" for f in cfg["fractions"]])
        ax.minorticks_off()
    ax = axes[-1] if has_ppl else None
    if has_ppl:
        ax.axhline(summary["ppl"]["full"]["1.0"]["ppl"], color="black", ls="--", lw=1, label="full cache")
        for m in scored:
            cells = summary["ppl"].get(m, {})
            xs = [f for f in cfg["fractions"] if str(f) in cells]
            ax.plot([100 * x for x in xs], [cells[str(x)]["ppl"] for x in xs], style(m), color=colors[m], label=m)
        if not result["kvpress"].get("live"):
            best = KVPRESS_RECORDED["ppl_best"]["ExpectedAttentionPress"]
            ax.plot([100 * x for x in sorted(best)], [best[x] for x in sorted(best)], ":", marker="x", color="0.4",
                    label="kvpress ExpectedAttention (issue 52, not this run)")
        p = cfg["ppl"]
        ax.set(title=f"perplexity ({p['prefix']} compressed + {p['continuation']})", xlabel=xlabel,
               ylabel="perplexity (lower is better)", xscale="log", yscale="log")
        ax.set_xticks([100 * f for f in cfg["fractions"]], [f"{100 * f:g}" for f in cfg["fractions"]])
        ax.minorticks_off()
    handles, labels = {}, []
    for a in axes:
        for h, label in zip(*a.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    ncol = 6 if len(labels) > 16 else 4
    rows = -(-len(labels) // ncol)
    legend_in = 0.45 + 0.19 * rows  # inches below the panels for the x labels and the legend's rows
    fig.set_size_inches(fig.get_size_inches()[0], 4.2 + legend_in)
    fig.legend([handles[label] for label in labels], labels, loc="lower center", ncol=ncol, fontsize=8,
               frameon=False)
    fig.suptitle(f"SmolLM2-135M-Instruct: quality against the bytes held "
                 f"({cfg['cases']} cases per context x depth)", fontsize=10)
    fig.tight_layout(rect=(0, (legend_in - 0.1) / (4.2 + legend_in), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048], help="prompt lengths in tokens")
    ap.add_argument("--run-contexts", type=int, nargs="+", default=None,
                    help="of --contexts, the lengths whose cases run (default: all). The cases are drawn for every "
                         "--contexts length, in order, so '--contexts 1024 2048 --run-contexts 2048' runs the same "
                         "2,048-token cases as a run of both (a 2048-only --contexts draws others)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], help="needle depths (0-1)")
    ap.add_argument("--cases", type=int, default=2, help="passkey cases per context x depth (the issue wants 20)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.125, 0.25, 0.5],
                    help="fractions of a bfloat16 full cache's bytes (--axis bytes) or of the prompt's tokens")
    ap.add_argument("--axis", choices=["bytes", "tokens"], default="bytes",
                    help="bytes (default): every method holds the fraction of a bfloat16 full cache's bytes, its "
                         "budget the tokens that fit (token_bytes()); tokens: budget = round(fraction x prompt)")
    ap.add_argument("--kv-bits", nargs="+", default=[None], type=kv_bits_choice,
                    help="per spec, the caches to run: 'none' (keys and values unquantized), 8, 4, 3, 2 "
                         "(AttnzooCache(kv_bits=...), Hadamard-rotated), 8u, 4u, 3u, 2u (unrotated, "
                         "kv_rotate=False); e.g. --kv-bits none 8 4")
    ap.add_argument("--evict", nargs="+", default=["always"], choices=["always", "prefill"],
                    help="per spec: 'always' (the budget holds at every step, the default) and/or 'prefill' (the "
                         "prompt compressed at prefill, every later token kept, as kvpress's presses do; method "
                         "names end in /prefill)")
    ap.add_argument("--layers", nargs="+", default=["flat"], choices=["flat", "pyramid"],
                    help="per spec: 'flat' (the budget in every layer, the default) and/or 'pyramid' (the same "
                         "total spread from (1 + slope) x budget at the first layer to (1 - slope) x at the last, "
                         "zt.layer_budgets; method names get +pyramid)")
    ap.add_argument("--pyramid-slope", type=float, default=0.5, help="the slope of --layers pyramid, in [0, 1)")
    ap.add_argument("--specs", nargs="*", default=None,
                    help="evicting specs to run (default: every registered spec with a cache evictor; none given: "
                         "the full cache only, e.g. beside kvpress)")
    ap.add_argument("--exclude", nargs="+", default=[], help="evicting specs left out of the default set")
    ap.add_argument("--ppl-docs", type=int, default=1, help="texts scored for perplexity (0: none)")
    ap.add_argument("--ppl-prefix", type=int, default=768)
    ap.add_argument("--ppl-continuation", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default="quality")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "images" / "quality.png"),
                    help="the plot's path ('' for none)")
    ap.add_argument("--model", default=None,
                    help="a checkpoint folder saved after zt.apply (e.g. attnzoo experiment finetune's model/): "
                         "its own spec at each fraction (AttnzooCache budgets; never applied again, so trained "
                         "tensors stay), the full cache being the same model with no budget; no kvpress. With "
                         "--specs: those specs applied to it instead (refused when its spec holds trained "
                         "tensors, e.g. ssa's temperatures); --specs alone: the full cache only")
    ap.add_argument("--kvpress-python", default=None,
                    help="an interpreter with torch, an older transformers and kvpress: run kvpress's presses live")
    ap.add_argument("--kvpress-path", action="append", default=[],
                    help="a side folder put first on the kvpress interpreter's sys.path (repeatable)")
    ap.add_argument("--kvpress-side", action="append", default=[],
                    help="a side folder holding kvpress, put last on its sys.path (repeatable)")
    ap.add_argument("--kvpress-presses", nargs="+", default=KVPRESS_PRESSES)
    ap.add_argument("--kvpress-bits", nargs="+", default=[None], type=lambda v: None if v == "none" else int(v),
                    help="kvpress's cache: none (a bfloat16 DynamicCache) and/or bits of transformers' quanto "
                         "QuantizedCache (kvpress pairs presses with it; optimum-quanto in a --kvpress-side folder), "
                         "each press then keeping the tokens that fit the same bytes")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="run nothing: join these results of runs on the same cases into one (--out/--name/--plot)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--kvpress-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not 0 <= args.pyramid_slope < 1:
        ap.error(f"--pyramid-slope must be in [0, 1), got {args.pyramid_slope}")
    if args.run_contexts is not None and not set(args.run_contexts) <= set(args.contexts):
        ap.error(f"--run-contexts must be among --contexts {args.contexts}, got {args.run_contexts}")
    return args


def merge(paths: list[str]) -> dict:
    """One result from several runs on the same cases (e.g. attnzoo's specs, kvpress's presses and a perplexity-only
    run, each its own process): the first run's configuration; every other run must have asked the same passkey
    cases (the full cache's keys per context, depth and case) and scored the same text, else one line names it.
    Methods join the tables in the order of the files; a method in two files is refused."""
    runs = [(p, json.loads(Path(p).read_text())) for p in paths]
    first_path, result = runs[0]
    result = json.loads(json.dumps(result))  # a copy
    key = lambda r: {(x["context"], x["depth"], x["case"]): x["key"] for x in r["passkey"].get("full", [])}  # noqa: E731
    same_ppl = lambda r: (r["config"]["ppl"], r["config"]["seed"])  # noqa: E731
    for path, other in runs[1:]:
        theirs, ours = key(other), key(result)
        if any(ours.get(c, k) != k for c, k in theirs.items()) or same_ppl(other) != same_ppl(result):
            raise SystemExit(f"--merge: {path} ran other passkey cases or another text than {first_path}")
        for c in theirs:  # a perplexity-only first run takes its cases from the others
            if c not in ours:
                result["passkey"].setdefault("full", []).extend(
                    x for x in other["passkey"]["full"] if (x["context"], x["depth"], x["case"]) == c)
        for part in ("passkey", "ppl"):
            for method, rows in other[part].items():
                if method == "full":
                    continue
                if method in result[part]:
                    raise SystemExit(f"--merge: method {method!r} is in {path} and in an earlier file")
                result[part][method] = rows
        result["held"].update(other.get("held", {}))
        result["meta"]["method_seconds"].update(
            {m: t for m, t in other["meta"]["method_seconds"].items() if m != "full"})
        if other["kvpress"].get("live"):
            result["kvpress"] = other["kvpress"]
        result["meta"]["complete"] = result["meta"].get("complete", True) and other["meta"].get("complete", True)
    result["config"]["contexts"] = sorted({x["context"] for x in result["passkey"].get("full", [])}) or \
        result["config"]["contexts"]
    result["config"]["methods"] = ["full", *[m for m in result["passkey"] if m != "full"],
                                   *[m for m in result["ppl"] if m not in result["passkey"]]]
    result["meta"]["merged_from"] = [str(p) for p in paths]
    result["meta"]["command"] = "; ".join(r["meta"]["command"] for _, r in runs)
    result["summary"] = summarise(result)
    return result


def main(argv=None) -> dict:
    args = parse(argv)
    if args.kvpress_worker:
        kvpress_worker(args.kvpress_worker)
        return {}
    if args.merge:
        return write(args, merge(args.merge), done=True)
    import torch
    from tqdm import tqdm

    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.transformers import models

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    if args.model:  # a checkpoint saved after zt.apply (a fine-tuned model): its own spec, no plain model
        import transformers

        plain, zoo = None, zt.from_pretrained(args.model, dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, local_files_only=True)
        folder = args.model
        names, aliases = [zoo.config.attnzoo["name"]], {}
        if args.specs is not None:  # --specs with --model: none (the full cache only), or specs applied to it
            names, aliases = evicting_specs(args.specs)
            trained = [n for n, _ in zoo.named_parameters() if ".attnzoo." in n]
            if names and trained:
                raise SystemExit(f"--model {args.model} --specs {' '.join(names)}: applying a spec would drop the "
                                 f"model's trained attnzoo tensors ({trained[0]}, ...); give --specs only for a "
                                 "model whose spec holds none (e.g. vanilla), or no --specs for its own spec")
    else:
        plain, tokenizer = zt.smollm2(progress=not args.no_progress)
        zoo, _ = zt.smollm2(progress=False)
        folder = models.ensure(models.SMOLLM2, progress=False).folder
        names, aliases = evicting_specs(args.specs, args.exclude)
    own = bool(args.model) and args.specs is None  # the loaded model's own spec: never applied again
    methods = [(name if bits is None else f"{name}@{bits}") + ("" if shape == "flat" else f"+{shape}")
               + ("" if evict == "always" else f"/{evict}")
               for name in names for bits in args.kv_bits for shape in args.layers for evict in args.evict]
    cases = passkey_cases(tokenizer, args.contexts, args.depths, args.cases, args.seed)
    if args.run_contexts is not None:  # drawn for every --contexts length (the same cases), run for these
        cases = [c for c in cases if c["context"] in args.run_contexts]
    docs = ppl_docs(tokenizer, args.ppl_docs, args.ppl_prefix, args.ppl_continuation, args.seed)
    per_method = len(cases) + len(docs)
    total = per_method * (1 + len(methods) * len(args.fractions))
    if args.kvpress_python:
        total += per_method * len(args.kvpress_presses) * len(args.fractions) * len(args.kvpress_bits)
    progress = tqdm(total=total, disable=args.no_progress, desc="quality", unit="case", file=sys.stderr)
    passkey: dict = {}
    ppl: dict = {}
    held: dict = {}
    seconds: dict = {}

    t0 = time.perf_counter()
    # --model: the "full cache" is that model through an AttnzooCache with no budget (its spec, nothing evicted)
    def whole():
        return None if plain is not None else zt.AttnzooCache(zoo, budget=None)

    for case in cases:
        answer, _ = run_passkey(plain or zoo, tokenizer, case, whole(), args.max_new_tokens)
        passkey.setdefault("full", []).append(
            {"fraction": 1.0, "context": case["context"], "depth": case["depth"], "case": case["case"],
             "key": case["key"], "answer": answer, "correct": answer_matches(answer, case["key"])})
        progress.update(1)
    for doc in docs:
        nll, n, _ = run_ppl(plain or zoo, doc, args.ppl_prefix, whole())
        ppl.setdefault("full", []).append({"fraction": 1.0, "doc": doc["doc"], "nll": nll, "tokens": n})
        progress.update(1)
    seconds["full"] = time.perf_counter() - t0
    report(args, argv, started, methods, aliases, passkey, ppl, held, seconds, {}, done=False)

    for method in methods:
        name, bits = split_method(method)
        t0 = time.perf_counter()
        for fraction in args.fractions:
            ratios = []

            def budget_for(length: int, fraction=fraction, name=name, bits=bits, method=method) -> int:
                if args.axis == "tokens":
                    return budget_of(fraction, length)
                return byte_budget(fraction, length, zoo.config, name, bits, recent_of(method))

            def spread(budget: int, method=method):  # one budget, or one per layer (the same total)
                flat = layer_shape(method) == "flat"
                layers = zoo.config.num_hidden_layers  # (before the first apply the model has no attnzoo layers)
                return budget if flat else zt.layer_budgets(layers, budget, slope=args.pyramid_slope)

            for case in cases:
                budget = budget_for(len(case["ids"]))
                record = getattr(zoo.config, "attnzoo", None) or {}
                per_layer = spread(budget)
                if not own and (record.get("name"), record.get("budget")) != (name, per_layer):
                    zt.apply(zoo, name, budget=per_layer)
                cache = zt.AttnzooCache(zoo, budget=per_layer, **cache_options(method))
                progress.set_postfix_str(f"{method} {pct(fraction)} {case['context']}")
                answer, _ = run_passkey(zoo, tokenizer, case, cache, args.max_new_tokens)
                ratios.append(counted_bytes(zoo, cache, name, bits) / full_kv_bytes(zoo, len(case["ids"])))
                passkey.setdefault(method, []).append(
                    {"fraction": fraction, "context": case["context"], "depth": case["depth"], "case": case["case"],
                     "key": case["key"], "answer": answer, "correct": answer_matches(answer, case["key"]),
                     "budget": budget})
                progress.update(1)
            for doc in docs:
                budget = budget_for(args.ppl_prefix)
                per_layer = spread(budget)
                if not own:  # a loaded model keeps its spec and trained tensors: the cache sets the budget
                    zt.apply(zoo, name, budget=per_layer)
                cache = zt.AttnzooCache(zoo, budget=per_layer, **cache_options(method))
                nll, n, _ = run_ppl(zoo, doc, args.ppl_prefix, cache)
                ratios.append(counted_bytes(zoo, cache, name, bits) / full_kv_bytes(zoo, args.ppl_prefix))
                ppl.setdefault(method, []).append({"fraction": fraction, "doc": doc["doc"], "nll": nll, "tokens": n,
                                                   "budget": budget})
                progress.update(1)
            if ratios:
                held.setdefault(method, {})[str(fraction)] = sum(ratios) / len(ratios)
        seconds[method] = time.perf_counter() - t0
        report(args, argv, started, methods, aliases, passkey, ppl, held, seconds, {}, done=False)

    kv: dict = {}
    if args.kvpress_python:
        t0 = time.perf_counter()
        live = run_kvpress(args, folder, cases, docs, tokenizer, progress, full_kv_bytes(zoo, 1))
        seconds["kvpress"] = time.perf_counter() - t0
        if "error" in live:
            kv["why"] = f"the kvpress worker failed: {live['error']}"
        else:
            kv["live"] = {"versions": live["versions"], "errors": live["errors"], "quantized": live["quantized"]}
            passkey.update(live["passkey"])
            ppl.update(live["ppl"])
            held.update(live["held"])
    progress.close()
    return report(args, argv, started, methods, aliases, passkey, ppl, held, seconds, kv, done=True)


def report(args, argv, started, names, aliases, passkey, ppl, held, seconds, kv, done) -> dict:
    """Writes the JSON, the markdown and the plot (after every method, so that an interrupted run keeps what it
    measured: `meta.complete` says whether it finished)."""
    import torch
    import transformers

    from attnzoo.bench import cpu_model

    wall = time.perf_counter() - started
    command = "python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "meta": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "python": platform.python_version(), "model": (f"{args.model} (--model)" if args.model
                                                               else "SmolLM2-135M-Instruct (Q4_1 gguf, float32)"),
                 "wall_s": wall, "method_seconds": seconds, "command": command.strip(),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "complete": done},
        "config": {"contexts": args.contexts if args.run_contexts is None else
                   [c for c in args.contexts if c in args.run_contexts], "drawn_contexts": args.contexts,
                   "depths": args.depths, "cases": args.cases,
                   "fractions": args.fractions, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
                   "methods": ["full", *names],
                   "ppl": {"docs": args.ppl_docs, "prefix": args.ppl_prefix, "continuation": args.ppl_continuation,
                           "how": "prefix compressed at prefill; continuation teacher-forced token by token "
                                  "through the compressed cache (decode-time eviction on); full cache: one "
                                  "forward"},
                   "passkey": {"intro": INTRO, "needle": NEEDLE, "question": QUESTION,
                               "answer_prefix": ANSWER_PREFIX, "filler": str(CORPUS.relative_to(ROOT)),
                               "match": "first number in the answer == key"},
                   "axis": args.axis, "kv_bits": args.kv_bits,
                   "bytes": BYTES_RULE if args.axis == "bytes" else
                   "tokens: budget = round(fraction x prompt tokens); every cache is float32"},
        "aliases": aliases,
        "passkey": passkey,
        "ppl": ppl,
        "held": held,
        "kvpress": kv or {"why": "no --kvpress-python given", "recorded": KVPRESS_RECORDED["source"]},
    }
    result["summary"] = summarise(result)
    return write(args, result, done)


def write(args, result: dict, done: bool) -> dict:
    """The JSON, the markdown and the plot of ``result`` (``--out``, ``--name``, ``--plot``); the tables on stdout
    when the run is ``done``."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / f"{args.name}.md").write_text(to_markdown(result) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    if done:
        print(to_markdown(result))
    return result


if __name__ == "__main__":
    main()
