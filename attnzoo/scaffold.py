"""``attnzoo new-plugin NAME``: a plugin package to start from, as docs/plugin-tutorial.md builds it by hand.

The package holds one of each thing a plugin can add, each small and tested against a formula written from its
definition (not from attnzoo's reference backend):

- a row map on the query slot: a learnable per-dimension gain, ``q' = q * gain``;
- a logits transform with a Triton fragment and a learnable per-head parameter: ``l' = l * exp(t_h)`` (a
  temperature on the logits), so the triton backend can run it too;
- an evictor: drop the cached token whose key has the largest norm, never the first ``sink`` tokens (the
  "key norm" rule of kvpress's KnormPress);
- a spec using all three, and tests: the formulas, the evictor's rule, the conformance suite.
"""

from __future__ import annotations

import keyword
import os
import re
import shutil
from pathlib import Path

_NAME = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
#: the longest plugin name: its kinds (``<name>_logit_temperature``) stay readable, its spec name valid
MAX_NAME = 40


def names(name: str) -> dict[str, str]:
    """The names the package uses for plugin ``name``: distribution, module, kinds, spec. ValueError (one line)
    for a name that cannot be a package name."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_NAME:
        shown = repr(name) if len(repr(name)) <= MAX_NAME + 2 else repr(name)[:MAX_NAME] + "..."
        raise ValueError(f"plugin name {shown}: use at most {MAX_NAME} lowercase letters and digits, words joined "
                         "by - or _ (e.g. mygate, rope-scale)")
    ident = name.replace("-", "_")
    if keyword.iskeyword(ident):
        raise ValueError(f"plugin name '{name}' is a Python keyword")
    return {"name": name, "dist": f"attnzoo-{name}", "module": f"attnzoo_{ident}", "ident": ident,
            "gain": f"{ident}_query_gain", "temperature": f"{ident}_logit_temperature",
            "evictor": f"{ident}_key_norm", "spec": name}


def scaffold(name: str, where: Path | str = ".") -> Path:
    """Write the package ``attnzoo-<name>/`` under ``where`` and return its path. Refuses (ValueError) to write
    into an existing directory."""
    n = names(name)
    where = Path(where)
    if not where.is_dir():
        why = "a dangling symbolic link" if where.is_symlink() and not where.exists() else (
            "not a directory" if where.exists() else "no such directory")
        raise ValueError(f"--dir {where}: {why}")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"--dir {where}: not writable")
    root = where / n["dist"]
    if os.path.lexists(root):
        raise ValueError(f"{root}: already exists (choose another name or directory)")
    files = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        f"{n['module']}/__init__.py": MODULE,
        f"{n['module']}/{n['spec']}.yaml": SPEC,
        "tests/test_formulas.py": TEST_FORMULAS,
        "tests/test_conformance.py": TEST_CONFORMANCE,
    }
    root.mkdir()
    try:
        for relative, template in files.items():
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "x", encoding="utf-8") as handle:  # "x": never through a planted file or link
                handle.write(template.format(**n))
    except OSError as exc:  # e.g. the disk is full: remove the half-written package, which was ours alone
        shutil.rmtree(root, ignore_errors=True)
        raise ValueError(f"{root}: cannot write: {exc.strerror or exc}") from None
    return root


PYPROJECT = '''[build-system]
requires = ["hatchling>=1.21"]
build-backend = "hatchling.build"

[project]
name = "{dist}"
version = "0.1.0"
description = "attnzoo plugin {name}: a query gain, a logit temperature (with a Triton fragment), a key-norm evictor"
readme = "README.md"
requires-python = ">=3.11"
dependencies = ["attnzoo"]

[project.optional-dependencies]
test = ["pytest>=8"]

[project.entry-points.attnzoo]
{ident} = "{module}"

[tool.hatch.build.targets.wheel]
packages = ["{module}"]
'''

README = '''# {dist}

An [attnzoo](https://github.com/) plugin, scaffolded by `attnzoo new-plugin {name}` (see attnzoo's
docs/plugin-tutorial.md for what each piece is).

- `{gain}` (query slot, a row map): `q' = q * gain`, gain (D,) learnable, initially 1.
- `{temperature}` (logits slot): `l' = l * exp(t_h)`, t (H,) learnable, initially 0; it has a Triton fragment.
- `{evictor}` (an evictor): drops the cached token whose key has the largest norm, never the first `sink`.
- the spec `{spec}` uses all three.

```bash
pip install -e .                          # registers the plugin through its `attnzoo` entry point
pytest tests                              # its formulas, its evictor's rule, the conformance suite
attnzoo conformance --plugin {dist}       # every backend, from the command line
```
'''

MODULE = '''"""attnzoo plugin {name}: a row map, a logits transform with a Triton fragment, an evictor and a spec."""

from pathlib import Path

import torch
from pydantic import Field

import attnzoo
from attnzoo.transforms.lowering import TritonLogits


class QueryGain(attnzoo.RowMapTransform):
    """q' = q * gain: a learnable gain per head dimension (initially 1)."""

    kind = "{gain}"
    slot = attnzoo.Slot.QUERY
    summary = "q' = q * gain (per dimension, learnable)"

    def parameters(self):
        return [attnzoo.ParamSpec("gain", ("D",), 1.0)]

    def map(self, rows, positions, params):
        # rows (B, H, N, D); params["gain"] (D,) in the rows' dtype; the result keeps the rows' shape
        return rows * params["gain"]


class LogitTemperature(attnzoo.LogitsTransform):
    """l' = l * exp(t_h): a learnable temperature per head on the logits (initially 0: no change)."""

    kind = "{temperature}"
    slot = attnzoo.Slot.LOGITS
    summary = "l' = l * exp(t_h) (per head, learnable)"

    def parameters(self):
        return [attnzoo.ParamSpec("t", ("H",), 0.0)]

    def apply(self, logits, ctx, params):
        # logits (B, H', Nq, Nk) for the query heads ctx.heads (1, H', 1, 1) holds (all of them, or the selector
        # head alone): index per-head parameters with it, never by position; params["t"] (H,)
        return logits * torch.exp(params["t"][ctx.heads])

    def triton(self):
        # float32 tiles: {{x}} the logits in, {{y}} the logits out, {{p_t}} the head's value of parameter t;
        # one derivative dy/dx and one dy/dt per parameter
        return TritonLogits(forward="{{x}} * tl.exp({{p_t}})", derivative="tl.exp({{p_t}})",
                            params=("t",), param_derivatives=("{{y}}",))


class KeyNormOptions(attnzoo.EvictorOptions):
    sink: int = Field(1, ge=0, description="the first tokens are never evicted")


class KeyNorm(attnzoo.Evictor):
    """Drop the cached token whose key has the largest L2 norm (per key/value head), never the first `sink`."""

    kind = "{evictor}"
    Options = KeyNormOptions
    summary = "evict the largest key norm, keep the first `sink` tokens"
    largest = True  # evict the largest score
    per_head = True  # each key/value head keeps its own set
    independent_scores = True  # removing a token changes no other token's score

    def check_budget(self, budget):
        if budget is not None and budget <= self.options.sink:
            return f"{evictor}.sink ({{self.options.sink}}) must be smaller than the budget ({{budget}})"
        return None

    def score(self, cache):
        return cache.keys.float().norm(dim=-1)  # (B, H_kv, M)

    def protected(self, cache):
        return cache.positions <= self.options.sink  # positions are 1-based


@attnzoo.hookimpl
def register_transforms(register):
    register(QueryGain)
    register(LogitTemperature)


@attnzoo.hookimpl
def register_evictors(register):
    register(KeyNorm)


@attnzoo.hookimpl
def register_specs(register):
    register(Path(__file__).with_name("{spec}.yaml"))
'''

SPEC = '''name: {spec}
summary: a query gain and a logit temperature; the cache evicts the largest key norm
attention: {{causal: true}}
transforms:
  - {{kind: {gain}}}
  - {{kind: {temperature}}}
cache: {{evictor: {evictor}, budget: 64, sink: 1}}
'''

TEST_FORMULAS = '''"""The plugin's transforms against formulas written from their definitions, in float64."""

import math
from types import SimpleNamespace

import torch

import attnzoo
from {module} import KeyNorm


def attention_by_hand(q, k, v, logit_scale=1.0):
    """softmax(logit_scale * q k^T / sqrt(D), causal) v, written out."""
    n, d = q.shape[-2], q.shape[-1]
    logits = logit_scale * (q @ k.transpose(-1, -2)) / math.sqrt(d)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1) @ v


def test_query_gain_is_q_times_gain():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, dtype=torch.float64) for _ in range(3))
    variant = attnzoo.compile({{"name": "gain-only", "transforms": [{{"kind": "{gain}"}}]}}, backend="reference")
    gain = torch.randn(4, dtype=torch.float64)
    got = variant(q, k, v, params={{"{gain}.gain": gain}})
    torch.testing.assert_close(got, attention_by_hand(q * gain, k, v))


def test_logit_temperature_scales_each_heads_logits():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 7, 4, dtype=torch.float64) for _ in range(3))
    variant = attnzoo.compile({{"name": "temperature-only", "transforms": [{{"kind": "{temperature}"}}]}},
                              backend="reference")
    t = torch.tensor([0.0, 0.5, -1.0], dtype=torch.float64)
    got = variant(q, k, v, params={{"{temperature}.t": t}})
    for h in range(3):
        torch.testing.assert_close(got[:, h], attention_by_hand(q[:, h], k[:, h], v[:, h], math.exp(t[h])))


def test_evictor_drops_the_largest_key_norm_but_never_the_first_token():
    keys = torch.zeros(1, 1, 5, 2, dtype=torch.float64)
    keys[0, 0, :, 0] = torch.tensor([9.0, 1.0, 7.0, 3.0, 2.0])  # token 1 has the largest norm but is protected
    cache = SimpleNamespace(keys=keys, positions=torch.arange(1, 6).view(1, 1, 5))
    evictor = KeyNorm(KeyNorm.options_model()(evictor="{evictor}", budget=4, sink=1))
    assert evictor.victim(cache).tolist() == [[2]]  # the slot of position 3, norm 7


def test_the_spec_decodes_within_its_budget():
    variant = attnzoo.compile("{spec}", backend="reference")
    cache = variant.new_cache(batch=1, budget=8)
    torch.manual_seed(2)
    for _ in range(12):
        q, k, v = (torch.randn(1, 2, 1, 4, dtype=torch.float64) for _ in range(3))
        variant.decode(q, k, v, cache)
    assert len(cache) == 8
'''

TEST_CONFORMANCE = '''"""The conformance suite on what this plugin registered: its spec and the specs using its
transforms, against attnzoo's reference, in float64 and float32, every shape (seconds on these two backends). More
backends: attnzoo conformance --plugin {dist}; the Triton kernels on CPU, the quick profile (every check, fewer
shapes): TRITON_INTERPRET=1 attnzoo conformance --plugin {dist} --backend triton --quick. Here that is
runner.build_cases(..., profile="quick"); shapes=/skip= take fnmatch patterns such as "gqa-n1030"."""

import torch

import attnzoo
from attnzoo.conformance import runner


def test_the_plugin_passes_the_conformance_suite():
    registry = attnzoo.get_registry()
    assert registry.plugins["{ident}"].errors == []
    cases = runner.build_cases(registry, None, ["reference", "blocked"], (torch.float64, torch.float32),
                               plugin="{dist}")
    results = runner.run_suite(cases)
    failures = [f"{{r.id}}: {{r.message}}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]
    assert sum(r.status == "pass" for r in results) > 20
'''
