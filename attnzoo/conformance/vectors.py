"""Test vectors: inputs, expected outputs and gradients computed by the reference backend in float64.

Stored per spec as ``vectors/<spec>.safetensors`` (tensors) and ``vectors/<spec>.json`` (cases: id, comment,
flags naming the kind of bug targeted, shapes, seed, mode). ``python -m attnzoo.conformance.vectors`` regenerates
them byte-identically (same attnzoo and torch versions). Loading uses safetensors only: no pickle.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save

VECTOR_DIR = Path(__file__).parent / "vectors"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class VectorCase:
    id: str
    comment: str
    flags: tuple[str, ...]
    batch: int
    heads: int
    kv_heads: int
    length: int
    head_dim: int
    mode: str = "batch"  # "batch" (outputs and gradients) or "decode" (token by token with a budget)
    budget: int | None = None
    masked_rows: bool = False
    zero_keys: bool = False

    def seed(self, spec_name: str) -> int:
        return int.from_bytes(hashlib.sha256(f"{spec_name}/{self.id}".encode()).digest()[:4], "little")


BATCH_CASES = (
    VectorCase("single-token", "N = 1: the query sees only itself", ("odd-length",), 1, 2, 1, 1, 4),
    VectorCase("gqa-17", "grouped-query attention, 4 query heads over 2 key/value heads, N = 17",
               ("gqa", "odd-length"), 2, 4, 2, 17, 4),
    VectorCase("odd-length-63", "N = 63: a partial last block for any block size that is a power of two",
               ("odd-length",), 1, 2, 2, 63, 4),
    VectorCase("masked-row", "key_mask hides the first key of batch row 1: its first query has no key at all",
               ("masked-row", "gqa"), 2, 2, 1, 9, 4, masked_rows=True),
)
DECODE_CASES = (
    VectorCase("decode-budget", "token-by-token decoding of 24 tokens with a 6-token budget",
               ("eviction", "bos", "decode"), 1, 2, 1, 24, 4, mode="decode", budget=6),
    VectorCase("decode-tie", "all keys zero: every score ties, eviction must follow the tie-break",
               ("eviction-tie", "bos", "decode"), 1, 2, 1, 12, 4, mode="decode", budget=5, zero_keys=True),
)


def cases_for(spec) -> tuple[VectorCase, ...]:
    return BATCH_CASES + (DECODE_CASES if spec.cache is not None else ())


def make_inputs(variant, case: VectorCase, spec_name: str) -> dict[str, torch.Tensor]:
    """Seeded inputs of a case (float64): q, k, v, the output cotangent, params (perturbed), key_mask."""
    gen = torch.Generator().manual_seed(case.seed(spec_name))
    b, h, hkv, n, d = case.batch, case.heads, case.kv_heads, case.length, case.head_dim

    def normal(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    tensors = {"q": normal(b, h, n, d), "k": normal(b, hkv, n, d), "v": normal(b, hkv, n, d),
               "cotangent": normal(b, h, n, d)}
    if case.zero_keys:
        tensors["k"] = torch.zeros_like(tensors["k"])
    init = variant.init_params(num_heads=h, head_dim=d, num_kv_heads=hkv, dtype=torch.float64)
    for key in sorted(init):
        tensors[f"param.{key}"] = init[key] + 0.5 * normal(*init[key].shape)
    for key, (_, declared) in sorted(variant.plan.token_inputs().items()):  # per-token inputs (B, H, N)
        tensors[f"input.{key}"] = declared.bias_init + normal(b, h, n)
    if case.masked_rows:
        mask = torch.ones(b, n, dtype=torch.bool)
        mask[-1, 0] = False
        tensors["key_mask"] = mask
    return tensors


def params_of(tensors: dict[str, torch.Tensor], dtype=None, requires_grad=False, prefix: str = "param."
              ) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tensors.items():
        if key.startswith(prefix):
            value = value.to(dtype) if dtype is not None else value.clone()
            out[key.removeprefix(prefix)] = value.requires_grad_(requires_grad)
    return out


def inputs_of(tensors: dict[str, torch.Tensor], dtype=None, tokens: slice | None = None
              ) -> dict[str, torch.Tensor] | None:
    """The per-token inputs of a case (``input.<kind>.<name>``, (B, H, N)), the tokens ``tokens`` of them, or
    None when it has none."""
    out = params_of(tensors, dtype, prefix="input.")
    if tokens is not None:
        out = {key: value[..., tokens] for key, value in out.items()}
    return out or None


def run_batch(variant, inputs: dict, dtype, grad: bool, device="cpu", selection: bool = False, documents=None
              ) -> dict[str, torch.Tensor]:
    """The batch form on ``inputs`` (float64, CPU) cast to ``dtype`` and moved to ``device``: out, and the
    gradients of q, k, v and every parameter (``grad``), or F (``selection``); ``documents``: packed input."""
    # copies: the inputs are shared through the memo, and requires_grad_ below must not touch them
    q, k, v = (inputs[n].to(device=device, dtype=dtype, copy=True) for n in ("q", "k", "v"))
    params = {key: p.to(device=device, copy=True) for key, p in params_of(inputs, dtype).items()}
    token_inputs = {key: t.to(device=device, copy=True) for key, t in (inputs_of(inputs, dtype) or {}).items()}
    positions = inputs.get("positions")
    positions = positions.to(device) if positions is not None else None
    key_mask = inputs.get("key_mask")
    key_mask = key_mask.to(device) if key_mask is not None else None
    if not grad:
        with torch.no_grad():
            result = variant(q, k, v, params=params, positions=positions, key_mask=key_mask,
                             return_accumulated=selection, inputs=token_inputs or None, documents=documents)
        if selection:
            return {"out": result[0], "F": result[1]}
        return {"out": result}
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for p in (*params.values(), *token_inputs.values()):
        p.requires_grad_()
    out = variant(q, k, v, params=params, positions=positions, key_mask=key_mask, inputs=token_inputs or None,
                  documents=documents)
    wrt = {"q": q, "k": k, "v": v, **{f"param.{key}": p for key, p in params.items()},
           **{f"input.{key}": t for key, t in token_inputs.items()}}
    grads = torch.autograd.grad(out, list(wrt.values()), inputs["cotangent"].to(device=device, dtype=dtype),
                                allow_unused=True)
    result = {"out": out.detach()}
    for (name, x), g in zip(wrt.items(), grads, strict=True):
        result[f"grad.{name}"] = g.detach() if g is not None else torch.zeros_like(x).detach()
    return result


def run_case(variant, case: VectorCase, tensors: dict[str, torch.Tensor], dtype=torch.float64):
    """Run one case on ``variant``; returns the results as a dict of tensors (out, grad.*, kept positions)."""
    q, k, v = (tensors[name].to(dtype) for name in ("q", "k", "v"))
    if case.mode == "decode":
        params = params_of(tensors, dtype)
        cache = variant.new_cache(batch=case.batch, budget=case.budget)
        with torch.no_grad():
            steps = [variant.decode(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], cache, params=params,
                                    inputs=inputs_of(tensors, dtype, slice(i, i + 1)))
                     for i in range(case.length)]
        return {"out": torch.cat(steps, dim=2), "kept_positions": cache.positions.clone()}
    return run_batch(variant, tensors, dtype, grad=True)


def generate(spec, registry=None) -> tuple[bytes, str]:
    """The vector files of one spec: (safetensors bytes, JSON text). Deterministic."""
    from ..dispatch import compile as compile_spec

    variant = compile_spec(spec, backend="reference", registry=registry)
    tensors: dict[str, torch.Tensor] = {}
    meta_cases = []
    for case in cases_for(spec):
        inputs = make_inputs(variant, case, spec.name)
        expected = run_case(variant, case, inputs)
        for name, value in {**inputs, **{f"expected.{k}": v for k, v in expected.items()}}.items():
            tensors[f"{case.id}.{name}"] = value.detach().contiguous()
        meta_cases.append({**asdict(case), "flags": list(case.flags), "seed": case.seed(spec.name),
                           "tensors": sorted(n for n in tensors if n.startswith(f"{case.id}."))})
    meta = {"format": FORMAT_VERSION, "spec": spec.name, "spec_hash": spec.hash,
            "spec_canonical": json.loads(spec.canonical_json()), "dtype": "float64",
            "generated_by": "python -m attnzoo.conformance.vectors", "cases": meta_cases}
    # one metadata key: safetensors writes its metadata map in no fixed order
    header = json.dumps({"spec": spec.name, "spec_hash": spec.hash}, sort_keys=True)
    blob = save(dict(sorted(tensors.items())), metadata={"attnzoo": header})
    return blob, json.dumps(meta, indent=1, sort_keys=True) + "\n"


def load(spec_name: str, directory: Path = VECTOR_DIR) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a spec's vectors; raises FileNotFoundError if none were generated."""
    meta = json.loads((directory / f"{spec_name}.json").read_text())
    return meta, load_file(str(directory / f"{spec_name}.safetensors"))


def write_all(directory: Path = VECTOR_DIR, registry=None) -> list[Path]:
    """Regenerate the vectors of every built-in spec into ``directory``."""
    from ..registry import get_registry

    reg = registry or get_registry()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in sorted(reg.specs):
        if reg.origin[("specs", name)] != "attnzoo.builtin_specs":
            continue
        blob, meta = generate(reg.specs[name], reg)
        (directory / f"{name}.safetensors").write_bytes(blob)
        (directory / f"{name}.json").write_text(meta)
        written += [directory / f"{name}.safetensors", directory / f"{name}.json"]
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else VECTOR_DIR
    for path in write_all(target):
        print(path)
