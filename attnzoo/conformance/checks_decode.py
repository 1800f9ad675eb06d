"""The decode checks: a prefill and token-by-token decoding against the batch truth (``decode``), packed prompts
prefilled into a cache (``packed/prefill``), the evictor's rule and budgets (``evictor``), decoding past eviction
against the reference's own decoding (``evicted-decode``), a left-padded batch through eviction against each row
alone (``padded-decode``), and the backend's fast decoding step against the full path's Python rule
(``fast-step``); with the decode loop they share. Built on :mod:`.checks` (the target, seeded
inputs, the memo and the tolerance rule).
"""

from __future__ import annotations

import torch

from ..backends.base import Backend
from ..decode import check as fast_rule
from . import eviction
from .checks import AXES, OFFSET, PACKED_LENGTHS, Shape, Target, Unsupported, close, compare, memo, random_case
from .vectors import inputs_of, params_of, run_batch


def _decode(variant, inputs, dtype, device="cpu", budget=None, prefill=0, first_position=1, watch=False,
            keep=(0, ""), trail=None):
    """Prefill the first ``prefill`` tokens, then decode the rest one by one. Returns (out, cache, problems):
    ``problems`` lists budget overruns, protected tokens evicted (with ``watch``) and positions 1..k of
    ``keep = (k, why)`` (:func:`eviction.must_keep`) missing after a step. ``trail``: a list that gets, after the
    prefill and after each step, (the step's output on CPU, :func:`eviction.kept_positions`, tokens evicted so
    far)."""
    q, k, v = (inputs[n].to(device=device, dtype=dtype) for n in ("q", "k", "v"))
    params = {key: p.to(device) for key, p in params_of(inputs, dtype).items()}
    cache = variant.new_cache(batch=q.shape[0], budget=budget)
    cache.next_position = first_position
    watcher = eviction.WatchedVictims(cache.evictor) if watch and cache.evictor is not None else None
    problems: list[str] = []
    outs = []
    with torch.no_grad():
        if prefill:
            outs.append(variant.prefill(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], cache, params,
                                        inputs=_token_inputs(inputs, dtype, device, slice(0, prefill))))
            if trail is not None:
                trail.append((outs[-1].cpu(), eviction.kept_positions(cache), cache.evicted))
        for i in range(prefill, q.shape[2]):
            outs.append(variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params,
                                       inputs=_token_inputs(inputs, dtype, device, slice(i, i + 1))))
            if trail is not None:
                trail.append((outs[-1].cpu(), eviction.kept_positions(cache), cache.evicted))
            if budget is not None and cache.num_tokens > budget and not problems:
                problems.append(f"cache holds {cache.num_tokens} tokens after step {i + 1}, over its budget "
                                f"{budget}")
            lost = [p for p in range(first_position, first_position + min(keep[0], i + 1))
                    if not bool((cache.positions == p).any(-1).all())]
            if lost and not problems:
                problems.append(f"position {lost[0]} was evicted by step {i + 1}, but {keep[1]}: the spec says it "
                                f"is never evicted")
    if watcher is not None:
        problems += watcher.problems
    return torch.cat(outs, dim=2), cache, problems


def _token_inputs(inputs, dtype, device, tokens):
    found = inputs_of(inputs, dtype, tokens)
    return {key: t.to(device) for key, t in found.items()} if found else None


def check_decode(target: Target) -> None:
    """A prefill followed by token-by-token decoding (no budget) equals the float64 batch truth, from position 1
    and from an offset past float16's range. The allowance comes from the reference's *batch form* in the
    tested dtype: a decode-only bug (shared by the reference's own decoding) cannot widen it."""
    if not target.spec.attention.causal:
        raise Unsupported("spec is not causal: no decoding")
    target.require(decode=True)
    n = 45  # past the 32-token windows of the shipped local specs
    base = random_case(target, Shape("decode", 2, 4, 2, n, 8))
    for first in (1, OFFSET):
        inputs = {**base, "positions": torch.arange(first, first + n)}
        truth = memo(target, ("decode-truth", first),
                     lambda inputs=inputs: run_batch(target.reference(), inputs, torch.float64, False))["out"]
        low = None
        if target.dtype != torch.float64:
            low = memo(target, ("decode-low", first, target.dtype),
                       lambda inputs=inputs: run_batch(target.reference(), inputs, target.dtype, False))["out"]
        got, _, _ = _decode(target.variant(), inputs, target.dtype, target.device, prefill=11, first_position=first)
        compare(target, f"prefill + decode from position {first} vs batch", {"out": got}, {"out": truth},
                {"out": low} if low is not None else None, inputs)


def _prefill_documents(variant, inputs: dict, dtype, device, budget, packed: bool) -> torch.Tensor:
    """Prefill the documents of a packed row: packed into a cache of one row per document, or each alone into its
    own cache (the truth); the outputs side by side."""
    q, k, v = (inputs[n].to(device=device, dtype=dtype) for n in ("q", "k", "v"))
    params = {key: p.to(device) for key, p in params_of(inputs, dtype).items()}
    with torch.no_grad():
        if packed:
            cache = variant.new_cache(batch=len(PACKED_LENGTHS), budget=budget)
            token_inputs = _token_inputs(inputs, dtype, device, slice(None))
            return variant.prefill(q, k, v, cache, params, inputs=token_inputs, documents=list(PACKED_LENGTHS))
        outs, start = [], 0
        for length in PACKED_LENGTHS:
            tokens = slice(start, start + length)
            cache = variant.new_cache(batch=1, budget=budget)
            outs.append(variant.prefill(q[:, :, tokens], k[:, :, tokens], v[:, :, tokens], cache, params,
                                        inputs=_token_inputs(inputs, dtype, device, tokens)))
            start += length
        return torch.cat(outs, dim=2)


def check_packed_prefill(target: Target) -> None:
    """Three prompts packed in one row (1, 63, 200) prefilled into a cache with one row per document, with the
    spec's evictor at a budget of 24 (eviction during the prefill), equal each prompt prefilled alone."""
    if not target.spec.attention.causal:
        raise Unsupported("spec is not causal: no decoding")
    target.require(decode=True)
    budget = 24 if target.spec.cache is not None else None
    inputs = random_case(target, Shape("packed", 1, 4, 2, sum(PACKED_LENGTHS), 8))
    truth = memo(target, ("packed-prefill", torch.float64),
                 lambda: _prefill_documents(target.reference(), inputs, torch.float64, "cpu", budget, False))
    got = _prefill_documents(target.variant(), inputs, target.dtype, target.device, budget, True)
    close(target, f"packed prefill {PACKED_LENGTHS}, budget {budget}", got, truth, None, inputs, AXES["out"])


def _tied_keys(inputs: dict, mode: str, gen: torch.Generator) -> dict:
    """``inputs`` with keys whose norms or directions tie (:data:`eviction.KEY_MODES`), integer-valued."""
    b, hkv, n, d = inputs["k"].shape
    keys = eviction.crafted_keys(mode, b, hkv, n, d, gen, torch.float64) / d  # O(1) logits
    return {**inputs, "k": keys}


def check_evictor(target: Target) -> None:
    """Evictor properties. On crafted caches (:func:`eviction.check_rule_on_crafted_caches`), at budgets 2, 5 and 8
    (those it accepts) and the budgets derived from the evictor (:func:`eviction.budgets_for`: its smallest accepted
    budget, the one just above what it protects, one between), with random keys and keys whose norms or directions
    tie: it evicts exactly the token its declared rule names and never a protected one, nor one the spec itself
    protects. In real decoding, a budget >= N changes nothing, and at each derived budget (where eviction happens;
    at the smallest also with every key the same vector, so that every score computed from the keys ties), the
    budget holds after every step, no protected token is evicted, and what the spec itself protects (BOS under
    ``protect_bos``, a ``sink``) is never evicted."""
    if target.spec.cache is None:
        raise Unsupported("spec has no cache evictor")
    target.require(decode=True)
    variant = target.variant()
    factory = lambda: variant.plan.evictor_cls(target.spec.cache)  # noqa: E731 - a fresh evictor per use
    has_accumulator = "accumulator" in target.spec.slots()
    budgets = eviction.budgets_for(factory, has_accumulator)
    keep = eviction.must_keep(target.spec)
    eviction.check_rule_on_crafted_caches(factory, eviction.crafted_budgets(factory, budgets), has_accumulator,
                                          target.generator("crafted"), keep)
    n = max(24, max(budgets) + 8)  # every derived budget evicts, several times
    inputs = random_case(target, Shape(f"evict-n{n}", 1, 2, 1, n, 8))
    truth = memo(target, ("evict-truth", n),
                 lambda: run_batch(target.reference(), inputs, torch.float64, False))["out"]
    low = None
    if target.dtype != torch.float64:
        low = memo(target, ("evict-low", n, target.dtype),
                   lambda: run_batch(target.reference(), inputs, target.dtype, False))["out"]
    full, cache, problems = _decode(variant, inputs, target.dtype, target.device, budget=n, watch=True)
    close(target, "budget >= N", full, truth, low, inputs, AXES["out"])
    if cache.evicted or problems:
        raise AssertionError(f"budget >= N: {cache.evicted} tokens evicted {'; '.join(problems)}")
    # and, at the smallest budget, every key the same vector: every key norm, key direction and attention weight ties
    tied = _tied_keys(inputs, "identical", target.generator("tied-keys"))
    for budget in budgets:
        for keys, run in [("", inputs)] + ([(", identical keys", tied)] if budget == budgets[0] else []):
            _, cache, problems = _decode(variant, run, target.dtype, target.device, budget=budget,
                                         prefill=min(4, budget), watch=True, keep=keep)
            if problems:
                raise AssertionError(f"budget {budget}{keys}: {problems[0]}")
            if cache.num_tokens != budget or not cache.evicted:
                raise AssertionError(f"budget {budget}{keys}: cache holds {cache.num_tokens} tokens after {n} "
                                     f"steps, {cache.evicted} evicted")


#: decode steps after the prefill in :func:`check_evicted_decode` (at least; twice the budget when that is more)
EVICTED_STEPS = 12


def evicted_runs(budgets: list[int]) -> list[tuple[int, int, int]]:
    """(budget, prefill, tokens) of each run of :func:`check_evicted_decode`: per budget, a prefill shorter than the
    budget (half of it, at least one token) and one longer (budget + 3: the prefill itself evicts), then
    max(:data:`EVICTED_STEPS`, 2 x budget) decode steps, each of which evicts."""
    return [(budget, prefill, prefill + max(EVICTED_STEPS, 2 * budget))
            for budget in budgets for prefill in sorted({max(1, budget // 2), budget + 3})]


def _evicted_trail(variant, inputs, dtype, device, budget, prefill) -> list:
    trail: list = []
    _decode(variant, inputs, dtype, device, budget=budget, prefill=prefill, trail=trail)
    return trail


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> tuple[int, int]:
    """The (batch row, key/value head) of the first row of kept positions that differs."""
    for i in range(want.shape[0]):
        for j in range(want.shape[1]):
            if got.shape[2] != want.shape[2] or not torch.equal(got[i, j], want[i, j]):
                return i, j
    return 0, 0


def check_evicted_decode(target: Target) -> None:
    """Decoding past eviction on the backend under test equals the reference backend's decoding of the same spec,
    inputs and budget, step by step: the output of the prefill and of every decode step (the tolerance rule against
    the reference's float64 decoding, floor only, as for decode vectors) and the positions the cache keeps after
    each (exactly). At the budgets :func:`eviction.budgets_for` derives from the evictor, with a prefill shorter
    and one longer than the budget (:func:`evicted_runs`). Needs no stored vectors: plugin specs get it too.

    Where the reference run in the tested dtype itself keeps other positions than in float64 (a near tie that
    precision cannot settle), that run is compared up to the step before."""
    spec, variant, budgets = _decoding_budgets(target)
    evicting = 0
    for budget, prefill, n in evicted_runs(budgets):
        inputs = random_case(target, Shape(f"evicted-decode-n{n}", 2, 4, 2, n, 8))
        run = ("evicted-decode", budget, prefill, n)
        truth = memo(target, (*run, torch.float64), lambda inputs=inputs, budget=budget, prefill=prefill:
                     _evicted_trail(target.reference(), inputs, torch.float64, "cpu", budget, prefill))
        same = truth
        if target.dtype != torch.float64:
            same = memo(target, (*run, target.dtype), lambda inputs=inputs, budget=budget, prefill=prefill:
                        _evicted_trail(target.reference(), inputs, target.dtype, "cpu", budget, prefill))
        got = _evicted_trail(variant, inputs, target.dtype, target.device, budget, prefill)
        where = f"decode past eviction (spec '{spec.name}', budget {budget}, prefill {prefill} of {n} tokens)"
        steps = zip(got, truth, same, strict=True)
        for step, ((out, kept, _), (want, want_kept, evicted), (_, near, _)) in enumerate(steps):
            if not torch.equal(near, want_kept):
                break  # the reference itself keeps other positions in this precision: a near tie
            label = (f"the prefill of {prefill} tokens" if step == 0
                     else f"step {step} (the token at position {prefill + step})")
            label += f", {evicted} token{'s' if evicted != 1 else ''} evicted so far"
            if not torch.equal(kept, want_kept):
                i, j = _first_difference(kept, want_kept)
                raise AssertionError(f"{where}: after {label}: the cache keeps "
                                     f"positions {kept[i, j].tolist()} (batch row {i}, key/value head {j}) where "
                                     f"the reference keeps {want_kept[i, j].tolist()}")
            close(target, f"{where}: {label}: out", out, want, None, inputs, AXES["out"])
            evicting += evicted > 0
    if not evicting:
        raise AssertionError(f"decode past eviction (spec '{spec.name}'): not run, because no step after an "
                             f"eviction could be compared (the reference's float64 and "
                             f"{str(target.dtype).removeprefix('torch.')} decoding keep different positions)")


#: the padding before each row's prompt in :func:`check_padded_decode`, and the first chunk of its prefill (all
#: padding for the row behind 7)
PADDED_ROWS = (1, 3, 7)
PADDED_CHUNK = 7


def padded_runs(budgets: list[int]) -> list[tuple[int, int, int]]:
    """(budget, prompt width, tokens) of each run of :func:`check_padded_decode`: per budget, a prompt
    budget + 8 wide (the row behind 7 padding tokens has budget + 1 real ones: every row's prefill evicts), then
    max(8, 2 x budget) decode steps."""
    return [(budget, budget + PADDED_CHUNK + 1, budget + PADDED_CHUNK + 1 + max(8, 2 * budget)) for budget in budgets]


def padded_layout(width: int, n: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The real tokens (B, n) of :func:`check_padded_decode` (False: padding; row 0 also decodes a padding token
    half-way through its decode steps) and its steps: the prompt in two chunks, then one token at a time."""
    real = torch.ones(len(PADDED_ROWS), n, dtype=torch.bool)
    for row, pad in enumerate(PADDED_ROWS):
        real[row, :pad] = False
    real[0, width + (n - width) // 2] = False
    return real, [(0, PADDED_CHUNK), (PADDED_CHUNK, width)] + [(i, i + 1) for i in range(width, n)]


def _real_held(cache, row: int) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """What batch row ``row`` of ``cache`` holds of its real tokens: their positions per key/value head, in order
    ([] while it holds none), and the cache's per-token scores at them (F, the evictor's), ``{name: (H_kv, kept)}``
    on CPU."""
    if cache.positions is None:
        return [], {}
    valid = cache.valid
    heads = range(cache.positions.shape[1])
    real = [valid[row, j] if valid is not None else slice(None) for j in heads]
    positions = [cache.positions[row, j][real[j]] for j in heads]
    if not any(p.numel() for p in positions):
        return [], {}
    order = [p.argsort() for p in positions]
    scores = {name: torch.stack([t[row, j][real[j]][order[j]] for j in heads]).cpu()
              for name, t in cache.state.items()}
    return [p[o].tolist() for p, o in zip(positions, order, strict=True)], scores


def _padded_trail(variant, inputs, dtype, device, budget: int, width: int, alone: bool) -> list:
    """After each step of :func:`padded_layout`, per row: (the outputs of its real queries (H, t, D) on CPU, what
    it holds of its real tokens (:func:`_real_held`: positions, scores), tokens evicted so far), decoded as the
    left-padded batch, or (``alone``) each row alone, on its real tokens only, in the same steps (a step where the
    row has no real token is no step for it: it keeps what it kept)."""
    q, k, v = (inputs[n].to(device=device, dtype=dtype) for n in ("q", "k", "v"))
    params = {key: p.to(device) for key, p in params_of(inputs, dtype).items()}
    found = inputs_of(inputs, dtype) or {}
    token_inputs = {key: t.to(device) for key, t in found.items()}
    real, steps = padded_layout(width, q.shape[2])
    rows = range(len(PADDED_ROWS))
    caches = ([variant.new_cache(batch=1, budget=budget) for _ in rows] if alone
              else [variant.new_cache(batch=len(PADDED_ROWS), budget=budget)])
    trail = []
    with torch.no_grad():
        for start, stop in steps:
            call = variant.prefill if stop - start > 1 else variant.decode
            entry = []
            if not alone:
                cache = caches[0]
                mask = real[:, start:stop].to(device)
                out = call(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], cache, params,
                           key_mask=mask,
                           inputs={key: t[..., start:stop] for key, t in token_inputs.items()} or None)
                for row in rows:
                    entry.append((out[row][:, real[row, start:stop].to(out.device)].cpu(), _real_held(cache, row),
                                  cache.evicted))
            else:
                for row in rows:
                    cache = caches[row]
                    mine = torch.arange(start, stop)[real[row, start:stop]].to(device)
                    if mine.numel():
                        take = [t[row:row + 1].index_select(2, mine) for t in (q, k, v)]
                        given = {key: t[row:row + 1].index_select(-1, mine) for key, t in token_inputs.items()}
                        out = call(*take, cache, params, inputs=given or None)[0].cpu()
                    else:
                        out = q.new_empty(q.shape[1], 0, v.shape[3]).cpu()
                    entry.append((out, _real_held(cache, 0), cache.evicted))
            trail.append(entry)
    return trail


def check_padded_decode(target: Target) -> None:
    """A left-padded batch decodes what each of its rows decodes alone, through eviction: rows behind 1, 3 and 7
    padding tokens (:data:`PADDED_ROWS`), their prompt prefilled in two chunks (the first all padding for the row
    behind 7), then decoded token by token, row 0 decoding one padding token half-way (``decode``'s key mask). After
    every step, each row's real outputs (the tolerance rule against the reference's float64 decoding, floor only),
    the real positions it keeps (exactly) and the per-token scores at them (F, the evictor's: the tolerance rule)
    equal the reference's decoding of that row alone, on its real tokens only, in the same steps. At the budgets
    :func:`eviction.budgets_for` derives from the evictor, each with a prompt budget + 8 wide and
    max(8, 2 x budget) decode steps (:func:`padded_runs`). Catches an evictor that scores with padding queries'
    attention (issue 51: each padding query's attention went to its row's first real token's H2O score), padding
    queries' selections in F, and padding evicted or attended as a real token.

    Where the reference's own decoding of the rows alone keeps other positions in the tested dtype than in float64
    (a near tie), the run is compared up to the step before."""
    spec, variant, budgets = _decoding_budgets(target)
    evicting = 0
    for budget, width, n in padded_runs(budgets):
        inputs = random_case(target, Shape(f"padded-decode-n{n}", len(PADDED_ROWS), 4, 2, n, 8))
        run = ("padded-decode", budget, width, n)
        truth = memo(target, (*run, torch.float64), lambda inputs=inputs, budget=budget, width=width:
                     _padded_trail(target.reference(), inputs, torch.float64, "cpu", budget, width, True))
        same = truth
        if target.dtype != torch.float64:
            same = memo(target, (*run, target.dtype), lambda inputs=inputs, budget=budget, width=width:
                        _padded_trail(target.reference(), inputs, target.dtype, "cpu", budget, width, True))
        got = _padded_trail(variant, inputs, target.dtype, target.device, budget, width, False)
        where = (f"left-padded decode (spec '{spec.name}', budget {budget}, rows behind "
                 f"{', '.join(map(str, PADDED_ROWS))} padding tokens, a prompt of {width} then {n - width} steps)")
        for step, (rows, want_rows, near_rows) in enumerate(zip(got, truth, same, strict=True)):
            if any(near[1][0] != want[1][0] for near, want in zip(near_rows, want_rows, strict=True)):
                break  # the reference itself keeps other positions in this precision: a near tie
            label = ("the prompt's first chunk" if step == 0 else "the rest of the prompt" if step == 1
                     else f"decode step {step - 1}")
            for row, ((out, (kept, scores), _), (want, (want_kept, want_scores), evicted), (_, (_, near), _)) in \
                    enumerate(zip(rows, want_rows, near_rows, strict=True)):
                at = f"{where}: after {label}: batch row {row} (behind {PADDED_ROWS[row]} padding tokens)"
                if kept != want_kept:
                    head = next(j for j in range(max(len(kept), len(want_kept)))
                                if j >= len(kept) or j >= len(want_kept) or kept[j] != want_kept[j])
                    raise AssertionError(f"{at} keeps real positions {kept[head] if head < len(kept) else []} "
                                         f"(key/value head {head}) where the row alone keeps "
                                         f"{want_kept[head] if head < len(want_kept) else []}")
                close(target, f"{at}: out", out.unsqueeze(0), want.unsqueeze(0), None, None)
                for name, score in want_scores.items():
                    low = near.get(name) if target.dtype != torch.float64 else None
                    close(target, f"{at}: score '{name}' of the real tokens (positions {kept[0]} in key/value head 0)",
                          scores[name], score, low, None)
                evicting += evicted > 0
    if not evicting:
        raise AssertionError(f"left-padded decode (spec '{spec.name}'): not run, because no step after an eviction "
                             f"could be compared (the reference's float64 and "
                             f"{str(target.dtype).removeprefix('torch.')} decoding keep different positions)")


#: decode steps of the ``fast-step`` check after its prefill (at least; three times the budget when that is more)
FAST_STEPS = 40
#: the ``fast-step`` check's geometry (as :func:`attnzoo.decode.check.check_fast_step`'s defaults) and prefill
FAST_GEOMETRY = {"batch": 2, "heads": 4, "kv_heads": 2, "head_dim": 8}
FAST_PREFILL = 3


def offers_fast_steps(backend) -> bool:
    """Whether ``backend`` offers fast decoding steps at all: its class defines ``Backend.decode_step`` (the
    contract's default, and a ``decode_step = None``, offer none: every step takes the full path)."""
    offer = getattr(type(backend), "decode_step", None)
    return offer is not None and offer is not Backend.decode_step


def fast_kind(variant, budget: int | None, dtype: torch.dtype) -> str | None:
    """The fast step (:attr:`attnzoo.KVCache.lean_step_kind`) a cache of ``variant`` at ``budget`` takes once it is
    full, decoded in the ``fast-step`` check's geometry and dtype, or None (every step takes the full path)."""
    gen = torch.Generator().manual_seed(0)
    b, h, hkv, d = (FAST_GEOMETRY[key] for key in ("batch", "heads", "kv_heads", "head_dim"))
    n = FAST_PREFILL + (budget or 0) + 4
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    cache = variant.new_cache(b, budget=budget)
    with torch.no_grad():
        variant.prefill(q[:, :, :FAST_PREFILL], k[:, :, :FAST_PREFILL], v[:, :, :FAST_PREFILL], cache)
        for t in range(FAST_PREFILL, n):
            variant.decode(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], cache)
    return cache.lean_step_kind


def check_fast_step(target: Target) -> None:
    """The fast decoding step the backend offers (``Backend.decode_step``; on the blocked backend the plain step,
    and selective, sink + window, H2O and TOVA at their budget, in C where it is built) decodes what the full path
    decodes with the evictor's Python rule: :func:`attnzoo.decode.check.check_fast_step` on the variant under test,
    in the tested dtype, at each budget :func:`eviction.budgets_for` derives from the evictor (no budget without
    one) where a fast step is offered: outputs, positions kept after every step, the scores at the end.
    Unsupported where the backend offers no fast step (for any spec, or for this one), and off the CPU."""
    spec = target.spec
    if not spec.attention.causal:
        raise Unsupported("spec is not causal: no decoding")
    target.require(decode=True)
    if not offers_fast_steps(target.registry.backends[target.backend]):
        raise Unsupported(f"backend '{target.backend}' offers no fast decoding step (Backend.decode_step)")
    if torch.device(target.device).type != "cpu":
        raise Unsupported(f"the fast step is checked on the CPU only (attnzoo.decode.check.check_fast_step), not "
                          f"on {target.device}")
    variant = target.variant()
    if variant.plan.token_inputs():
        raise Unsupported("spec takes per-token inputs, which no fast step takes")
    budgets: list[int | None] = [None]
    if spec.cache is not None:
        factory = lambda: variant.plan.evictor_cls(spec.cache)  # noqa: E731 - a fresh evictor per use
        budgets = eviction.budgets_for(factory, "accumulator" in spec.slots())
    dtype = str(target.dtype).removeprefix("torch.")
    seed = int(target.generator("fast-step").initial_seed())
    offered = [budget for budget in budgets if fast_kind(variant, budget, target.dtype) is not None]
    if not offered:
        at = "" if spec.cache is None else f" at budget{'s' * (len(budgets) > 1)} {', '.join(map(str, budgets))}"
        raise Unsupported(f"backend '{target.backend}' offers no fast decoding step for this spec in {dtype}{at}: "
                          f"every step takes the full path")
    for budget in offered:
        try:
            fast_rule.check_fast_step(variant, budget, steps=max(FAST_STEPS, 3 * (budget or 0)),
                                      prefill=FAST_PREFILL, dtype=target.dtype, seed=seed, **FAST_GEOMETRY)
        except AssertionError as exc:
            raise AssertionError(f"fast step against the full path (budget {budget}, {dtype}): {exc}") from None


def _decoding_budgets(target):
    """(the spec, its variant, the budgets :func:`eviction.budgets_for` derives from its evictor, a fresh evictor
    per use) for the checks that decode through evictions; Unsupported without an evictor or causality."""
    spec = target.spec
    if spec.cache is None:
        raise Unsupported("spec has no cache evictor")
    if not spec.attention.causal:
        raise Unsupported("spec is not causal: no decoding")
    target.require(decode=True)
    variant = target.variant()
    return spec, variant, eviction.budgets_for(lambda: variant.plan.evictor_cls(spec.cache),
                                               "accumulator" in spec.slots())
