"""`make demo`: every shipped spec computed by every backend available here, then a pruned decode."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

import attnzoo
from attnzoo.backends.base import Mode
from attnzoo.dispatch import verdicts


def main() -> None:
    console = Console(width=150)
    torch.manual_seed(0)
    b, h, hkv, n, d = 1, 8, 2, 127, 32
    q = torch.randn(b, h, n, d, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, dtype=torch.float64)
    reg = attnzoo.get_registry()
    vanilla = attnzoo.attention(q, k, v, "vanilla", backend="reference")

    table = Table(title=f"every shipped spec, B={b} H={h} H_kv={hkv} N={n} D={d}, float64", title_justify="left")
    for col in ("spec", "transforms", "backend", "max |out - vanilla|", "decode == batch"):
        table.add_column(col)
    for name, spec in sorted(reg.specs.items()):
        variant = attnzoo.compile(spec)
        params = variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
        for key, value in params.items():  # move off the initial values so every transform does something
            params[key] = value + 0.3 * torch.randn_like(value)
        kinds = ", ".join(t.kind for t in spec.transforms) or "-"
        for backend, why in verdicts(variant.plan, reg, torch.device("cpu"), torch.float64, Mode.FORWARD).items():
            if why:
                table.add_row(name, kinds, backend, f"unsupported: {'; '.join(why)}", "")
                continue
            chosen = attnzoo.compile(spec, backend=backend)
            out = chosen(q, k, v, params=params)
            cache = chosen.new_cache(batch=b, budget=None)
            steps = torch.cat([chosen.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params)
                               for i in range(n)], dim=2)
            same = torch.allclose(steps, out, atol=1e-10, rtol=0)
            table.add_row(name, kinds, backend, f"{(out - vanilla).abs().max().item():.3e}", "yes" if same else "NO")
    console.print(table)

    console.print()
    table = Table(title="decoding 127 tokens with a 48-token budget (float64)", title_justify="left")
    for col in ("spec", "evictor", "cache tokens", "cache bytes", "evicted", "max |out - unpruned|"):
        table.add_column(col)
    for name in ("selective-pruned", "h2o", "tova", "streaming"):
        variant = attnzoo.compile(name)
        full = variant(q, k, v)
        cache = variant.new_cache(batch=b, budget=48)
        steps = torch.cat([variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache)
                           for i in range(n)], dim=2)
        table.add_row(name, variant.spec.cache.evictor, str(cache.num_tokens), str(cache.nbytes), str(cache.evicted),
                      f"{(steps - full).abs().max().item():.3e}")
    console.print(table)


if __name__ == "__main__":
    main()
