"""Checkpoints save and restore every tensor an attnzoo core owns (docs/transformers.md, Checkpoints): the
transforms' parameters and the token projections (the linear maps of the layer input for per-token inputs,
``attnzoo.nn.Attention.token_projections``), for every registered transform that has either, in every option
variant that changes them, and for a plugin transform with token inputs. Each is applied to a tiny Llama, moved off
its initial values, saved with ``save_pretrained`` and loaded with ``zt.from_pretrained``: every core tensor and
the logits come back exactly, and transformers' load report (which would list the core's tensors as unexpected
keys) is not shown.

Tiny randomly initialised models (2 layers, hidden 32, vocabulary 64), float32, no downloads."""

from __future__ import annotations

import contextlib
import io
import logging
import types
import typing
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnzoo  # noqa: E402
from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers.checkpoints import core_state  # noqa: E402
from attnzoo.registry import get_registry, new_registry  # noqa: E402
from attnzoo.transforms.base import TokenInput  # noqa: E402

VOCAB = 64
#: Values for the options a transform requires (no default): sizes that fit the tiny model and its short inputs.
REQUIRED = {"chunk": 4, "window": 6, "global_heads": 1, "length": 2, "cap": 30.0, "factor": 2.0}
#: Transforms that need other transforms beside them in a spec: differential attention's norm needs its map.
COMPANIONS: dict[str, list[dict]] = {"diff_norm": [{"kind": "diff"}]}
#: Transform variants that cannot be applied to a causal LM, with the reason (none of those with parameters today).
CANNOT_APPLY: dict[str, str] = {}


def make():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


def _alternatives(annotation, default) -> list:
    """The other values of an option: a Literal's other members, a bool's negation; nothing for free values."""
    if typing.get_origin(annotation) is typing.Literal:
        return [v for v in typing.get_args(annotation) if v != default]
    if annotation is bool:
        return [not default]
    return []


def variants(registry) -> list[tuple[str, dict]]:
    """(test id, transform entry) of every registered transform, in every variant that has parameters or token
    inputs: its defaults (required options from :data:`REQUIRED`), then each option changed on its own to each
    other value it may take. Variants with the same parameters and token inputs (names and shapes) as one already
    listed are the same to a checkpoint and are left out."""
    out, seen = [], set()
    for kind, cls in sorted(registry.transforms.items()):
        fields = cls.Options.model_fields
        needed = [k for k, f in fields.items() if k != "kind" and f.is_required()]
        if any(k not in REQUIRED for k in needed):
            out.append((kind, {"kind": kind, "problem": f"add a value for its options {needed} to REQUIRED"}))
            continue
        base = {"kind": kind, **{k: REQUIRED[k] for k in needed}}
        options = [base] + [{**base, k: v} for k, f in fields.items() if k != "kind" and not f.is_required()
                            for v in _alternatives(f.annotation, f.default)]
        for entry in options:
            transform = cls(cls.Options(**entry))
            params = tuple((p.name, tuple(p.shape)) for p in transform.parameters())
            inputs = tuple(i.name for i in transform.token_inputs())
            if not params and not inputs:
                continue
            signature = (kind, params, inputs)
            if signature in seen:
                continue
            seen.add(signature)
            changed = "-".join(f"{k}={v}" for k, v in entry.items() if k != "kind" and base.get(k) != v)
            out.append((f"{kind}{'-' + changed if changed else ''}", entry))
    return out


def perturb(model) -> dict[str, torch.Tensor]:
    """Move every tensor of the attnzoo cores off its initial value; returns the initial values."""
    initial = {k: v.detach().clone() for k, v in core_state(model).items()}
    with torch.no_grad():
        for value in core_state(model).values():
            value.add_(0.5 * torch.randn_like(value))
    return initial


@contextlib.contextmanager
def shown_by_transformers(capfd, caplog):
    """Everything transformers shows while the block runs, as a list of texts: what reaches a handler of its
    ``transformers`` logger (as its own stderr handler), what it propagates to the root logger (as under CI),
    warnings, and the process's stderr."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    capfd.readouterr()
    caplog.clear()
    transformers.utils.logging.enable_propagation()
    shown: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
            warnings.simplefilter("always")
            yield shown
    finally:
        transformers.utils.logging.disable_propagation()
        library.removeHandler(handler)
    shown += [stream.getvalue(), capfd.readouterr().err, *(r.getMessage() for r in caplog.records),
              *(str(w.message) for w in caught)]


def round_trip(spec, tmp_path, capfd, caplog):
    """Apply ``spec`` to a tiny Llama, perturb, save, load with zt.from_pretrained; check every core tensor, the
    logits (and greedy tokens, for token projections), and that transformers showed no load report (nor any
    warning naming the cores)."""
    model = zt.apply(make(), spec, budget=None)
    initial = perturb(model)
    state = core_state(model)
    assert state, "the spec gives the model no attnzoo tensor to save"
    ids = torch.randint(2, VOCAB, (2, 11))
    ids[:, 0] = 1
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    with shown_by_transformers(capfd, caplog) as shown:
        loaded = zt.from_pretrained(tmp_path)
    assert not [m for m in shown if "LOAD REPORT" in m or ".attnzoo." in m], shown

    got = core_state(loaded)
    assert got.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(got[key], value), key
        assert not torch.equal(got[key], initial[key]), f"{key} is at its initial value"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, want)
    if any(".token_projections." in key for key in state):  # the reported symptom: other greedy tokens
        greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert torch.equal(loaded.generate(ids[:1, :6], **greedy), model.generate(ids[:1, :6], **greedy))
    return model, loaded


VARIANTS = variants(get_registry())


def test_every_registered_transform_with_parameters_or_token_inputs_is_covered():
    """The registry is enumerated: every kind with parameters or token inputs in some variant is round-tripped,
    the forgetting gate's ``source: input`` (token projections) among them."""
    kinds = {entry["kind"] for _, entry in VARIANTS}
    assert {"query_temperature", "key_temperature", "value_temperature", "query_norm", "key_norm", "alibi_learnable",
            "attention_sink", "constant_temperature", "forgetting_gate", "sigmoid_output_gate", "sigmoid", "diff",
            "diff_norm"} <= kinds
    assert ("forgetting_gate", "input") in {(e["kind"], e.get("source")) for _, e in VARIANTS}


@pytest.mark.parametrize("entry", [entry for _, entry in VARIANTS], ids=[name for name, _ in VARIANTS])
def test_every_core_tensor_round_trips_through_save_pretrained(entry, tmp_path, capfd, caplog):
    kind = entry["kind"]
    if "problem" in entry:
        pytest.fail(f"transform '{kind}': {entry['problem']}")
    if kind in CANNOT_APPLY:
        pytest.skip(CANNOT_APPLY[kind])
    spec = {"name": "round-trip", "attention": {"causal": True}, "transforms": [entry, *COMPANIONS.get(kind, [])]}
    model, _ = round_trip(spec, tmp_path, capfd, caplog)
    if any(t.token_inputs() for t in model.model.layers[0].self_attn.attnzoo.variant.plan.transforms):
        assert any(".token_projections." in k for k in core_state(model))


class TokenBonus(attnzoo.LogitsTransform):
    """A plugin transform with a parameter and two per-token inputs: every key j gets the bonus
    ``scale_h * bonus_j * sigmoid(gate_j)`` (both inputs projected from the layer input by the core)."""

    kind = "token_bonus"
    slot = attnzoo.Slot.LOGITS

    def parameters(self):
        return [attnzoo.ParamSpec("scale", ("H",), 1.0)]

    def token_inputs(self):
        return [TokenInput("bonus", 0.0, "the key's bonus, (B, H, N)"), TokenInput("gate", 1.0, "its gate")]

    def features(self, rows, params):
        return {"b": params["scale"][:, None] * params["bonus"] * torch.sigmoid(params["gate"])}

    def apply(self, logits, ctx, params):
        return logits + self.bias(ctx, params, logits.dtype)

    def bias(self, ctx, params, dtype):
        return ctx.features(self.kind, "b")[1].to(dtype)

    def separable(self, ctx, params, dtype):
        query_b, key_b = ctx.features(self.kind, "b")
        return torch.zeros_like(query_b, dtype=dtype), key_b.to(dtype)


@pytest.fixture
def plugin_registry(monkeypatch):
    """The default registry with the plugin registered (a fresh registry, put back after the test)."""
    module = types.ModuleType("ckpt_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(TokenBonus))
    registry = new_registry(entry_points=False, extra_plugins=[("ckpt_plugin", module)])
    monkeypatch.setattr(attnzoo.registry, "_default", registry)
    return registry


def test_a_plugin_transforms_token_projections_round_trip(plugin_registry, tmp_path, capfd, caplog):
    spec = {"name": "bonus", "attention": {"causal": True}, "transforms": [{"kind": "token_bonus"}]}
    model, loaded = round_trip(spec, tmp_path, capfd, caplog)
    keys = sorted(k.split(".attnzoo.")[1] for k in core_state(model) if k.startswith("model.layers.0."))
    assert keys == ["token_projections.token_bonus__bonus.bias", "token_projections.token_bonus__bonus.weight",
                    "token_projections.token_bonus__gate.bias", "token_projections.token_bonus__gate.weight",
                    "transform_params.token_bonus__scale"]
    assert zt.load_transform_params(loaded, tmp_path) == sorted(core_state(model))


def test_load_transform_params_refuses_a_missing_or_extra_token_projection(tmp_path):
    spec = {"name": "fox-input", "attention": {"causal": True},
            "transforms": [{"kind": "forgetting_gate", "source": "input"}]}
    model = zt.apply(make(), spec, budget=None)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    file = tmp_path / "model.safetensors"
    with safe_open(file, framework="pt") as fh:
        meta = fh.metadata()
    weights = load_file(file)
    key = "model.layers.1.self_attn.attnzoo.token_projections.forgetting_gate__gate.weight"
    saved = weights.pop(key)
    save_file(weights, file, metadata=meta)
    with pytest.raises(zt.IntegrationError, match=f"holds no value for 1 attnzoo parameter.*first: {key}"):
        zt.load_transform_params(model, tmp_path)
    weights[key] = saved
    weights["model.layers.1.self_attn.attnzoo.token_projections.other__gate.weight"] = saved.clone()
    save_file(weights, file, metadata=meta)
    with pytest.raises(zt.IntegrationError, match="holds 1 attnzoo parameter.*model does not have.*other__gate"):
        zt.load_transform_params(model, tmp_path)


def test_a_report_that_lists_other_keys_is_shown_whole(tmp_path, capfd, caplog):
    """The report is hidden only when it lists the cores' tensors alone: a stray key of the model shows it."""
    spec = {"name": "fox-input", "attention": {"causal": True},
            "transforms": [{"kind": "forgetting_gate", "source": "input"}]}
    zt.apply(make(), spec, budget=None).save_pretrained(tmp_path)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    file = tmp_path / "model.safetensors"
    with safe_open(file, framework="pt") as fh:
        meta = fh.metadata()
    weights = load_file(file)
    weights["model.stray"] = torch.zeros(2)
    save_file(weights, file, metadata=meta)
    with shown_by_transformers(capfd, caplog) as shown:
        zt.from_pretrained(tmp_path)
    reports = [m for m in shown if "LOAD REPORT" in m]
    assert len(reports) >= 2  # the logger's handler and the root's (propagated) at least
    assert all("model.stray" in m and ".attnzoo.token_projections." in m for m in reports)
