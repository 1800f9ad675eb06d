"""``attnzoo new-plugin NAME``: a plugin package to start from, as docs/plugin-tutorial.md builds it by hand.

The package holds one of each thing a plugin can add, each small and tested against a formula written from its
definition (not from attnzoo's reference backend):

- a row map on the query slot: a learnable per-dimension gain, ``q' = q * gain``;
- a logits transform with a Triton fragment and a learnable per-head parameter: ``l' = l * exp(t_h)`` (a
  temperature on the logits), so the triton backend can run it too;
- an evictor: drop the cached token whose key has the largest norm, never the first ``sink`` tokens (the
  "key norm" rule of kvpress's KnormPress);
- a spec using all three, and tests: the formulas, the evictor's rule, the conformance suite.

``--kind`` writes a package of one thing instead (:data:`KINDS`): ``transform`` (a learnable query scale, a row
scale that every backend runs), ``map`` (a probability map in place of the softmax, with its blocked form) or
``evictor`` (an evictor-only package: a key-norm rule that keeps its sinks, and a spec that uses it with plain
attention); each with a spec, its formula tests and the conformance suite, green as written.
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
            "evictor": f"{ident}_key_norm", "spec": name, "scale": f"{ident}_query_scale",
            "map": f"{ident}_relu_mean"}


#: what ``--kind`` writes: ``all`` (the default: a row map, a logits transform with a Triton fragment, an evictor),
#: or a package of one thing
KINDS = ("all", "transform", "map", "evictor")


def summary(name: str, kind: str = "all") -> str:
    """One line: what ``scaffold(name, kind=kind)`` registers."""
    n = names(name)
    return {"all": f"transforms {n['gain']} (query), {n['temperature']} (logits, with a Triton fragment), "
                   f"evictor {n['evictor']}, spec {n['spec']}",
            "transform": f"transform {n['scale']} (query, a row scale), spec {n['spec']}",
            "map": f"transform {n['map']} (probability map, with its blocked form), spec {n['spec']}",
            "evictor": f"evictor {n['evictor']}, spec {n['spec']}"}[kind]


def scaffold(name: str, where: Path | str = ".", kind: str = "all") -> Path:
    """Write the package ``attnzoo-<name>/`` under ``where`` and return its path: of ``kind`` (:data:`KINDS`).
    Refuses (ValueError) to write into an existing directory."""
    if kind not in KINDS:
        raise ValueError(f"--kind {kind!r}: choose one of {', '.join(KINDS)}")
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
    module, spec, formulas, conformance, about = TEMPLATES[kind]
    files = {
        "pyproject.toml": PYPROJECT.replace("{description}", about),
        "README.md": README if kind == "all" else README_ONE,
        f"{n['module']}/__init__.py": module,
        f"{n['module']}/{n['spec']}.yaml": spec,
        "tests/test_formulas.py": formulas,
        "tests/test_conformance.py": conformance,
    }
    n = {**n, "summary": summary(name, kind), "kind": kind}
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
description = "attnzoo plugin {name}: {description}"
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

README_ONE = '''# {dist}

An [attnzoo](https://github.com/) plugin, scaffolded by `attnzoo new-plugin {name} --kind {kind}` (docs/plugins.md
explains the contract it implements): {summary}.

```bash
pip install -e .                          # registers the plugin through its `attnzoo` entry point
pytest tests                              # its formulas, the conformance suite
attnzoo conformance --plugin {dist}       # every backend, from the command line
```
'''

MODULE_TRANSFORM = '''"""attnzoo plugin {name}: a learnable query scale (a row scale: every backend runs it, no
Triton fragment needed) and a spec."""

from pathlib import Path

import torch

import attnzoo


class QueryScale(attnzoo.RowScaleTransform):
    """q_i *= 1 + s_h ln(i): a learnable scale per query head that grows with the query's absolute position i
    (as SSMax's s ln n does), 1 at init (s = 0)."""

    kind = "{scale}"
    slot = attnzoo.Slot.QUERY
    summary = "q_i *= 1 + s_h ln(i) (per head, learnable; 1 at init)"

    def parameters(self):
        return [attnzoo.ParamSpec("s", ("H",), 0.0)]

    def scale(self, rows, positions, params):
        # rows (B, H, N, D); positions (B, 1, N) int64, 1-based; params["s"] (H,) in the rows' dtype, and its
        # gradient must reach it (the conformance suite checks the gradients against finite differences)
        # -> the factor of each row, (B, H, N)
        return 1 + params["s"].view(1, -1, 1) * torch.log(positions.to(rows.dtype))


@attnzoo.hookimpl
def register_transforms(register):
    register(QueryScale)


@attnzoo.hookimpl
def register_specs(register):
    register(Path(__file__).with_name("{spec}.yaml"))
'''

SPEC_TRANSFORM = '''name: {spec}
summary: causal attention with a learnable, position-dependent query scale
attention: {{causal: true}}
transforms:
  - {{kind: {scale}}}
'''

TEST_FORMULAS_TRANSFORM = '''"""The plugin's transform against its formula written from its definition, in float64."""

import math

import torch

import attnzoo


def attention_by_hand(q, k, v):
    """softmax(q k^T / sqrt(D), causal) v, written out."""
    n, d = q.shape[-2], q.shape[-1]
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1) @ v


def test_query_scale_is_one_plus_s_log_position():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, dtype=torch.float64) for _ in range(3))
    s = torch.tensor([0.0, 0.5, -0.25], dtype=torch.float64)
    got = attnzoo.compile("{spec}", backend="reference")(q, k, v, params={{"{scale}.s": s}})
    i = torch.arange(1, 8, dtype=torch.float64)  # positions 1..N
    factor = 1 + s.view(3, 1) * torch.log(i)     # (H, N)
    torch.testing.assert_close(got, attention_by_hand(q * factor[..., None], k, v))


def test_at_init_it_is_plain_attention():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(attnzoo.compile("{spec}", backend="reference")(q, k, v), attention_by_hand(q, k, v))
'''

MODULE_MAP = '''"""attnzoo plugin {name}: a probability map in place of the softmax (ReLU attention averaged over
the keys a query sees, Wortsman et al. 2023), with its blocked form, and a spec."""

from pathlib import Path

import torch

import attnzoo


class ReluMean(attnzoo.ProbabilityTransform):
    """w_ij = relu(l_ij) / (the number of keys query i may see), 0 where the pair is not allowed."""

    kind = "{map}"
    slot = attnzoo.Slot.PROBABILITY
    summary = "ReLU attention: relu(l) / (the number of keys the query sees)"
    normalised = False  # True would declare that each row sums to 1 (the conformance suite then checks it)

    def weights(self, logits, allowed, ctx, params):
        # logits (B, H, Nq, Nk) in the input's dtype, anything at pairs not allowed (-inf, ...); allowed (bool,
        # broadcastable) -> weights of the logits' dtype and shape, exactly 0 where a pair is not allowed
        allowed = allowed.expand_as(logits)
        count = allowed.sum(-1, keepdim=True).clamp_min(1)
        return torch.where(allowed, torch.relu(torch.where(allowed, logits, 0.0)), 0.0) / count

    # the blocked form (the blocked backend runs it over key blocks): the weighted values and the key counts add up
    # over the blocks, in at least float32; divide at the end
    def start(self, out_shape, like):
        dtype = torch.promote_types(like.dtype, torch.float32)
        return {{"sum": like.new_zeros(out_shape, dtype=dtype),
                "count": like.new_zeros((*out_shape[:-1], 1), dtype=dtype)}}

    def update(self, state, logits, allowed, values, ctx, params):
        allowed = allowed.expand_as(logits)
        w = torch.where(allowed, torch.relu(torch.where(allowed, logits, 0.0)), 0.0).to(state["sum"].dtype)
        return {{"sum": state["sum"] + w @ values.to(w.dtype),
                "count": state["count"] + allowed.sum(-1, keepdim=True)}}

    def finish(self, state, params):
        return state["sum"] / state["count"].clamp_min(1)


@attnzoo.hookimpl
def register_transforms(register):
    register(ReluMean)


@attnzoo.hookimpl
def register_specs(register):
    register(Path(__file__).with_name("{spec}.yaml"))
'''

SPEC_MAP = '''name: {spec}
summary: causal ReLU attention averaged over the keys a query sees, in place of the softmax
attention: {{causal: true}}
transforms:
  - {{kind: {map}}}
'''

TEST_FORMULAS_MAP = '''"""The plugin's probability map against its formula written from its definition, in float64."""

import math

import torch

import attnzoo


def test_relu_mean_by_hand():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, dtype=torch.float64) for _ in range(3))
    got = attnzoo.compile("{spec}", backend="reference")(q, k, v)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(4)
    seen = torch.ones(7, 7, dtype=torch.bool).tril()        # causal: query i sees keys 1..i
    w = torch.relu(logits).masked_fill(~seen, 0.0) / seen.sum(-1, keepdim=True)
    torch.testing.assert_close(got, w @ v)


def test_the_blocked_form_gives_the_same():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 300, 8, dtype=torch.float64) for _ in range(3))  # several key blocks
    blocked = attnzoo.compile("{spec}", backend="blocked")(q, k, v)
    torch.testing.assert_close(blocked, attnzoo.compile("{spec}", backend="reference")(q, k, v))
'''

MODULE_EVICTOR = '''"""attnzoo plugin {name}: an evictor (the key-norm rule of kvpress's KnormPress, keeping the
first `sink` tokens) and a spec that uses it with plain attention."""

from pathlib import Path

import torch
from pydantic import Field

import attnzoo


class KeyNormOptions(attnzoo.EvictorOptions):
    sink: int = Field(1, ge=0, description="the first tokens are never evicted")


class KeyNorm(attnzoo.Evictor):
    """Drop the cached token whose key has the largest L2 norm (per key/value head), never the first `sink`."""

    kind = "{evictor}"
    Options = KeyNormOptions
    summary = "evict the largest key norm, keep the first `sink` tokens"
    largest = True  # evict the largest score; ties go to the oldest position
    per_head = True  # each key/value head keeps its own set
    independent_scores = True  # removing a token changes no other token's score

    def check_budget(self, budget):
        if budget is not None and budget <= self.options.sink:
            return f"{evictor}.sink ({{self.options.sink}}) must be smaller than the budget ({{budget}})"
        return None

    def score(self, cache):
        # (B, H_kv, M): one score per batch row, key/value head and cached token (another shape is refused)
        return cache.keys.float().norm(dim=-1)

    def protected(self, cache):
        # declare what is kept here, never by a score that is merely smaller: the suite's crafted caches give every
        # key the same norm, where a smaller score ties
        return cache.positions <= self.options.sink  # positions are 1-based


@attnzoo.hookimpl
def register_evictors(register):
    register(KeyNorm)


@attnzoo.hookimpl
def register_specs(register):
    register(Path(__file__).with_name("{spec}.yaml"))
'''

SPEC_EVICTOR = '''name: {spec}
summary: causal attention; the cache evicts the largest key norm and keeps the first token
attention: {{causal: true}}
transforms: []
cache: {{evictor: {evictor}, budget: 64, sink: 1}}
'''

TEST_FORMULAS_EVICTOR = '''"""The plugin's evictor against its rule, on caches written by hand."""

from types import SimpleNamespace

import torch

import attnzoo
from {module} import KeyNorm


def cache_with_norms(norms):
    keys = torch.zeros(1, 1, len(norms), 2, dtype=torch.float64)
    keys[0, 0, :, 0] = torch.tensor(norms, dtype=torch.float64)
    return SimpleNamespace(keys=keys, positions=torch.arange(1, len(norms) + 1).view(1, 1, -1))


def evictor(sink=1):
    return KeyNorm(KeyNorm.options_model()(evictor="{evictor}", budget=4, sink=sink))


def test_it_drops_the_largest_key_norm_but_never_a_sink():
    assert evictor().victim(cache_with_norms([9.0, 1.0, 7.0, 3.0, 2.0])).tolist() == [[2]]  # position 3, norm 7


def test_ties_go_to_the_oldest_token_after_the_sinks():
    assert evictor(sink=2).victim(cache_with_norms([5.0] * 5)).tolist() == [[2]]  # position 3


def test_the_spec_decodes_within_its_budget():
    variant = attnzoo.compile("{spec}", backend="reference")
    cache = variant.new_cache(batch=1, budget=8)
    torch.manual_seed(2)
    for _ in range(12):
        q, k, v = (torch.randn(1, 2, 1, 4, dtype=torch.float64) for _ in range(3))
        variant.decode(q, k, v, cache)
    assert len(cache) == 8 and bool((cache.positions == 1).any())  # the sink stays
'''

TEST_CONFORMANCE_ONE = '''"""The conformance suite on what this plugin registered ({summary}), against
attnzoo's reference, in float64 and float32, every shape (seconds on these two backends). More backends: attnzoo
conformance --plugin {dist}; fewer shapes: runner.build_cases(..., profile="quick")."""

import torch

import attnzoo
from attnzoo.conformance import runner


def test_the_plugin_passes_the_conformance_suite():
    registry = attnzoo.get_registry()
    assert registry.plugins["{ident}"].errors == []
    cases = runner.build_cases(registry, None, ["reference", "blocked"], (torch.float64, torch.float32),
                               plugin="{ident}")
    results = runner.run_suite(cases)
    failures = [f"{{r.id}}: {{r.message}}" for r in results if r.status == "fail"]
    assert not failures, failures[:5]
    assert sum(r.status == "pass" for r in results) > 20
'''

#: per kind: the module, the spec, the formula tests, the conformance test and the package's description
TEMPLATES = {
    "all": (MODULE, SPEC, TEST_FORMULAS, TEST_CONFORMANCE,
            "a query gain, a logit temperature (with a Triton fragment), a key-norm evictor"),
    "transform": (MODULE_TRANSFORM, SPEC_TRANSFORM, TEST_FORMULAS_TRANSFORM, TEST_CONFORMANCE_ONE,
                  "a learnable query scale"),
    "map": (MODULE_MAP, SPEC_MAP, TEST_FORMULAS_MAP, TEST_CONFORMANCE_ONE, "a probability map (ReLU attention)"),
    "evictor": (MODULE_EVICTOR, SPEC_EVICTOR, TEST_FORMULAS_EVICTOR, TEST_CONFORMANCE_ONE, "a key-norm evictor"),
}
