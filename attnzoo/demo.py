"""``make demo``: the story in one screen, declare -> compile -> run -> decode with eviction -> verify.

    python -m attnzoo.demo            # one screen, about a minute on 2 CPU cores
    python -m attnzoo.demo --details  # then every shipped spec on every backend here, and the full tables

1. **Declare**: a variant is a spec file (here the selective-attention spec with KV-cache pruning).
2. **Compile**: ``attnzoo.compile`` picks a backend per case and says why the others decline.
3. **Run**: the batch form on random inputs, against the float64 reference, timed against SDPA.
4. **Decode with eviction**: token by token with a budget; the cache stays at the budget.
5. **Verify**: the conformance suite on this spec (every check, the blocked backend against the reference),
   and the Triton kernels generated from the spec at build time.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

import attnzoo
from attnzoo.backends.base import Mode
from attnzoo.dispatch import verdicts

SPEC = "selective-pruned"


def _step(console, number, title, text):
    from rich.markup import escape

    console.print(f"[bold]{number}. {title}[/bold]  {escape(text)}", highlight=False)


def story(console: Console) -> bool:
    reg = attnzoo.get_registry()
    spec = attnzoo.load_spec(SPEC)
    path = attnzoo.__file__.rsplit("/", 1)[0] + f"/specs/{SPEC}.yaml"
    console.print(f"[bold]attnzoo {attnzoo.__version__}[/bold]: attention variants declared as data, held to a "
                  f"float64 reference. {len(reg.transforms)} transforms, {len(reg.evictors)} evictors, "
                  f"{len(reg.backends)} backends, {len(reg.specs)} specs registered (`attnzoo list`).")
    console.print()
    kinds = ", ".join(t.kind for t in spec.transforms)
    _step(console, 1, "Declare", f"specs/{SPEC}.yaml: transforms [{kinds}], cache evictor "
                                 f"'{spec.cache.evictor}' with budget {spec.cache.budget}; valid, hash "
                                 f"{spec.hash[:12]} (`attnzoo validate {path.rsplit('/', 2)[-2]}/{SPEC}.yaml`).")

    variant = attnzoo.compile(spec)
    chosen = {mode: next((b for b, why in verdicts(variant.plan, reg, torch.device("cpu"), torch.float32,
                                                     mode).items() if not why), "none") for mode in Mode}
    declined = {b: why[0] for b, why in verdicts(variant.plan, reg, torch.device("cpu"), torch.float32,
                                                 Mode.FORWARD).items() if why}
    _step(console, 2, "Compile", f"on this CPU in float32: forward -> {chosen[Mode.FORWARD]}, training -> "
                                 f"{chosen[Mode.BACKWARD]}, decoding -> {chosen[Mode.DECODE]}; "
                                 f"{len(declined)} backends decline, with reasons (`attnzoo explain {SPEC}`).")

    gen = torch.Generator().manual_seed(0)
    b, h, hkv, n, d = 1, 8, 2, 2048, 64
    q, k, v = (torch.randn(b, heads, n, d, generator=gen) for heads in (h, hkv, hkv))
    out = variant(q, k, v)
    exact = attnzoo.compile(spec, backend="reference")(q[..., :512, :].double(), k[..., :512, :].double(),
                                                       v[..., :512, :].double())
    error = (variant(q[..., :512, :], k[..., :512, :], v[..., :512, :]).double() - exact).abs().max().item()
    times = {"sdpa": [], "attnzoo": []}
    for _ in range(3):
        for name, fn in (("sdpa", lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1), is_causal=True)),
                         ("attnzoo", lambda: variant(q, k, v))):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ratio = min(times["attnzoo"]) / min(times["sdpa"])
    _step(console, 3, "Run", f"B={b} H={h} H_kv={hkv} N={n} D={d}: out {tuple(out.shape)}; max error against the "
                             f"float64 reference (N=512) {error:.1e}; {ratio:.2f}x the time of causal SDPA.")

    cache = variant.new_cache(batch=b)
    steps = 256
    qs, ks, vs = (torch.randn(b, heads, steps, d, generator=gen) for heads in (h, hkv, hkv))
    for i in range(steps):
        variant.decode(qs[:, :, i:i + 1], ks[:, :, i:i + 1], vs[:, :, i:i + 1], cache)
    memory = cache.memory()
    _step(console, 4, "Decode with eviction", f"{steps} tokens one by one: the cache holds {memory['tokens']} "
                                              f"(budget {memory['budget']}), evicted {memory['evicted']} by the "
                                              f"'{spec.cache.evictor}' rule, {memory['bytes'] / 1024:.0f} KiB.")

    from attnzoo.conformance import runner

    cases = runner.build_cases(reg, [SPEC], ["blocked"], (torch.float32,))
    results = runner.run_suite(cases)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "unsupported")}
    built = ""
    try:
        from attnzoo.backends.triton import build as builder

        artifact = builder.build(spec)
        built = (f"; Triton kernels generated from the spec at build time ({artifact.key[:12]}, "
                 f"{'cached' if artifact.hit else 'built'}: `attnzoo build`)")
    except (ImportError, ValueError) as exc:
        built = f"; Triton kernels: {exc}"
    _step(console, 5, "Verify", f"conformance of blocked against the reference: {counts['pass']} checks pass, "
                                f"{counts['fail']} fail ({counts['unsupported']} n/a){built}.")
    console.print()
    console.print("Next: `attnzoo conformance` (every spec x backend), `python -m attnzoo.demo --details`, "
                  "`attnzoo new-plugin NAME` (docs/plugin-tutorial.md).", highlight=False)
    return counts["fail"] == 0


def details(console: Console) -> None:
    """Every shipped spec on every backend available here (float64, against vanilla and its own decoding)."""
    torch.manual_seed(0)
    b, h, hkv, n, d = 1, 8, 2, 127, 32
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, dtype=torch.float64)
    reg = attnzoo.get_registry()
    vanilla = attnzoo.attention(q, k, v, "vanilla", backend="reference")
    table = Table(title=f"every shipped spec, B={b} H={h} H_kv={hkv} N={n} D={d}, float64", title_justify="left")
    for col in ("spec", "transforms", "backends that run it", "max |out - vanilla|", "decode == batch"):
        table.add_column(col, overflow="fold")
    for name, spec in sorted(reg.specs.items()):
        variant = attnzoo.compile(spec, backend="reference")
        params = variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
        params = {key: value + 0.3 * torch.randn_like(value) for key, value in params.items()}
        runs = [bk for bk, why in verdicts(variant.plan, reg, torch.device("cpu"), torch.float64,
                                           Mode.FORWARD).items() if not why]
        out = variant(q, k, v, params=params)
        cache = variant.new_cache(batch=b, budget=None) if spec.attention.causal else None
        same = "-"
        if cache is not None:
            steps = torch.cat([variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params)
                               for i in range(n)], dim=2)
            same = "yes" if torch.allclose(steps, out, atol=1e-10, rtol=0) else "NO"
        table.add_row(name, ", ".join(t.kind for t in spec.transforms) or "-", ", ".join(runs),
                      f"{(out - vanilla).abs().max().item():.3e}", same)
    console.print(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnzoo.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--details", action="store_true", help="also every shipped spec on every backend here")
    args = parser.parse_args(argv)
    console = Console(width=120)
    ok = story(console)
    if args.details:
        console.print()
        details(console)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
