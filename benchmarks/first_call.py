"""First-call latency of a spec on the triton backend, in a fresh process (run by benchmarks/gpu_check.py).

    python benchmarks/first_call.py SPEC [--dtype bfloat16] [--heads 16] [--head-dim 128] [--length 1024]

Times the first forward and the first backward pass of ``SPEC`` on the GPU (what a serving or training process
pays on its first request), then a second call (the steady state), and counts what Triton did on the way: kernels
compiled and kernels found in its cache (its compilation listener). Prints one JSON line. gpu_check runs it with
an empty Triton cache, without and with the kernels compiled at build time (``attnzoo build --compile-for``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--length", type=int, default=1024)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("first_call: needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton import knobs

    import attnzoo

    events: list[bool] = []
    knobs.compilation.listener = lambda **kw: events.append(bool(kw["cache_hit"]))
    dtype, device = getattr(torch, args.dtype), torch.device("cuda")
    variant = attnzoo.compile(args.spec, backend="triton")
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, args.heads, args.length, args.head_dim)
    params = {k: p.requires_grad_() for k, p in variant.init_params(args.heads, args.head_dim, dtype=dtype,
                                                                     device=device).items()}
    times = {}
    for call in ("first", "second"):
        q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_() for _ in range(3))
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = variant(q, k, v, params)
        torch.cuda.synchronize()
        forward = time.perf_counter() - start
        start = time.perf_counter()
        out.float().sum().backward()
        torch.cuda.synchronize()
        times[call] = {"forward_ms": forward * 1e3, "backward_ms": (time.perf_counter() - start) * 1e3}
    print(json.dumps({"spec": args.spec, **times, "compiled": events.count(False), "loaded": events.count(True)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
