"""The plugin registry: built-ins through hooks, isolation, duplicates, broken plugins reported by name."""

import inspect
import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

import attnzoo
from attnzoo import hookspecs
from attnzoo.registry import PluginWarning, new_registry


def plugin(name, **hooks):
    module = types.ModuleType(name)
    for hook, body in hooks.items():
        setattr(module, hook, attnzoo.hookimpl(body))
    return module


class Doubler(attnzoo.LogitsTransform):
    kind = "double_logits"
    slot = attnzoo.Slot.LOGITS

    def apply(self, logits, ctx, params):
        return 2 * logits


def isolated(*extra):
    return new_registry(entry_points=False, extra_plugins=extra)


def test_builtins_register_through_the_hooks():
    reg = new_registry(entry_points=False)
    assert {"query_temperature", "value_temperature", "selective_mask", "softcap", "alibi", "causal",
            "sliding_window"} <= set(reg.transforms)
    assert set(reg.evictors) >= {"selective", "h2o", "tova", "sink_window"}
    assert "reference" in reg.backends
    assert reg.origin[("transforms", "softcap")] == "attnzoo.transforms.builtin"
    assert all(p.builtin and not p.errors for p in reg.plugins.values())


def test_hook_register_transforms():
    reg = isolated(("doubler", plugin("doubler", register_transforms=lambda register: register(Doubler))))
    assert reg.transforms["double_logits"] is Doubler
    spec = attnzoo.load_spec({"name": "d", "transforms": [{"kind": "double_logits"}]}, registry=reg)
    q = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    out = attnzoo.compile(spec, registry=reg)(q, q, q)
    scaled = attnzoo.compile("vanilla")(q * 2, q, q)  # 2 * (q k) == (2q) k
    torch.testing.assert_close(out, scaled)
    # the default registry never saw it: registries are isolated
    with pytest.raises(attnzoo.SpecError, match=r"transforms\[0\]: unknown kind 'double_logits'"):
        attnzoo.load_spec({"name": "d", "transforms": [{"kind": "double_logits"}]})


def test_hook_register_evictors():
    class Newest(attnzoo.Evictor):
        kind = "drop_newest"

        def victim(self, cache):
            return cache.positions.argmax(-1)

    reg = isolated(("ev", plugin("ev", register_evictors=lambda register: register(Newest))))
    spec = attnzoo.load_spec({"name": "n", "cache": {"evictor": "drop_newest", "budget": 2}}, registry=reg)
    variant = attnzoo.compile(spec, registry=reg)
    cache = variant.new_cache(batch=1)
    x = torch.randn(1, 1, 4, 2)
    for i in range(4):
        variant.decode(x[:, :, i:i + 1], x[:, :, i:i + 1], x[:, :, i:i + 1], cache)
    assert cache.positions.flatten().tolist() == [1, 2]


class WindowOptions(attnzoo.EvictorOptions):
    window: int = 3


class RecentQueries(attnzoo.Evictor):
    """Keeps one score per query of a window of W (a state whose size depends on an option): the attention each
    of the last W queries gave each token; evicts the token with the least attention summed over the window."""

    kind = "recent_queries"
    Options = WindowOptions
    largest = False
    evict_after_attention = True
    needs_probabilities = True
    independent_scores = True

    def __init__(self, options):
        super().__init__(options)
        self.state_names = tuple(f"q{i}" for i in range(options.window))

    def update(self, cache, probs):
        per_head = probs[:, :, -1].detach().mean(dim=1).unsqueeze(1).expand_as(cache.positions)
        names = self.state_names
        for older, newer in zip(names[:0:-1], names[-2::-1], strict=True):  # shift the ring by one query
            cache.state[older] = cache.state[newer].clone()
        cache.state[names[0]] = per_head.clone()

    def score(self, cache):
        return sum(cache.state[name] for name in self.state_names)


def test_evictor_state_names_may_depend_on_its_options(tmp_path):
    file = tmp_path / "rq.json"
    file.write_text(json.dumps({"name": "rq", "cache": {"evictor": "recent_queries", "budget": 5, "window": 4}}))
    reg = isolated(("rq", plugin("rq", register_evictors=lambda register: register(RecentQueries),
                                 register_specs=lambda register: register(file))))
    spec = reg.specs["rq"]
    variant = attnzoo.compile(spec, registry=reg)
    cache = variant.new_cache(batch=1)
    x = torch.randn(1, 2, 9, 4, generator=torch.Generator().manual_seed(0))
    for i in range(9):
        variant.decode(x[:, :, i:i + 1], x[:, :, i:i + 1], x[:, :, i:i + 1], cache)
    assert set(cache.state) == {"q0", "q1", "q2", "q3"} and cache.num_tokens == 5 and cache.evicted == 4
    assert all(t.shape == cache.positions.shape for t in cache.state.values())
    from attnzoo.conformance import runner

    case = next(c for c in runner.build_cases(reg, ["rq"], ["reference"], (torch.float64,)) if c.check == "evictor")
    assert runner.run_case(case).status == "pass"


def test_hook_register_backends():
    class Echo(attnzoo.Backend):
        name = "echo"
        priority = 50

        def supports(self, plan, device, dtype, mode):
            return [] if mode != "backward" else ["echo has no backward"]

        def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
            return v

    reg = isolated(("echo", plugin("echo", register_backends=lambda register: register(Echo()))))
    variant = attnzoo.compile("vanilla", registry=reg)
    x = torch.randn(1, 1, 3, 2)
    assert variant(x, x, x + 1).equal(x + 1)  # auto picks the higher priority
    assert "echo       no: echo has no backward" in attnzoo.explain("vanilla", requires_grad=True, registry=reg)
    with pytest.raises(attnzoo.UnsupportedError, match="echo: echo has no backward"):
        attnzoo.compile("vanilla", backend="echo", registry=reg).backend_for("cpu", torch.float32, True)


def test_decode_dispatch_asks_for_the_decode_mode():
    """A higher-priority plugin backend that implements no decoding is never picked to decode (issue: it used to
    be, and decode raised NotImplementedError while explain named it)."""

    class ForwardOnly(attnzoo.Backend):
        name = "forward_only"
        priority = 50

        def supports(self, plan, device, dtype, mode):
            return []

        def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
            return v

    reg = isolated(("fo", plugin("fo", register_backends=lambda register: register(ForwardOnly()))))
    variant = attnzoo.compile("vanilla", registry=reg)
    x = torch.randn(1, 1, 3, 2)
    assert variant(x, x, x + 1).equal(x + 1)
    cache = variant.new_cache(batch=1)
    out = variant.decode(x[:, :, :1], x[:, :, :1], x[:, :, :1] + 1, cache)
    assert out.equal(x[:, :, :1] + 1)  # the one key's value: blocked decoded it
    assert variant.backend_for("cpu", torch.float32, "decode").name == "blocked"
    text = attnzoo.explain("vanilla", registry=reg, mode="decode")
    assert "forward_only no: backend 'forward_only' does not implement decoding" in text
    assert "auto -> blocked" in text
    named = attnzoo.compile("vanilla", backend="forward_only", registry=reg)
    with pytest.raises(attnzoo.UnsupportedError, match=r"\(decode\).*does not implement decoding"):
        named.decode(x[:, :, :1], x[:, :, :1], x[:, :, :1], named.new_cache(batch=1))


def test_flex_is_not_offered_for_decoding():
    variant = attnzoo.compile("ssa", backend="flex")
    x = torch.randn(1, 2, 1, 8)
    with pytest.raises(attnzoo.UnsupportedError, match="flex: backend 'flex' does not implement decoding"):
        variant.decode(x, x, x, variant.new_cache(batch=1))
    assert "flex       no: backend 'flex' does not implement decoding" in attnzoo.explain("ssa", mode="decode")


def test_hook_register_specs(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\ntransforms: [{kind: softcap, cap: 3.0}]\n")
    reg = isolated(("specs", plugin("specs", register_specs=lambda register: register(path))))
    assert reg.specs["mine"].transforms[0].cap == 3.0
    assert attnzoo.load_spec("mine", registry=reg).source == str(path)


def test_every_hook_is_documented_and_tested():
    names = [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("register_")]
    assert names == ["register_backends", "register_evictors", "register_specs", "register_transforms"]
    source = Path(__file__).read_text()
    for name in names:
        assert getattr(hookspecs, name).__doc__, name
        assert f"def test_hook_{name}(" in source, name


def test_duplicate_is_refused_and_reported_by_plugin_name():
    class Impostor(attnzoo.LogitsTransform):
        kind = "softcap"
        slot = attnzoo.Slot.LOGITS

        def apply(self, logits, ctx, params):
            return logits

    with pytest.warns(PluginWarning, match=r"plugin 'dup'.*transform 'softcap' is already registered"):
        reg = new_registry(entry_points=False, extra_plugins=[
            ("dup", plugin("dup", register_transforms=lambda register: (register(Doubler), register(Impostor))))])
    assert reg.transforms["softcap"].__module__ == "attnzoo.transforms.logits"
    assert "double_logits" not in reg.transforms  # a failing plugin registers nothing
    assert reg.plugins["dup"].errors
    with pytest.raises(attnzoo.PluginError, match="dup"):
        reg.check_pending()


@pytest.mark.parametrize(
    "bad, match",
    [
        (object, "subclass of Transform"),
        (type("NoKind", (attnzoo.LogitsTransform,), {"kind": "Bad Name", "slot": attnzoo.Slot.LOGITS}), "must match"),
        (type("WrongBase", (attnzoo.LogitsTransform,), {"kind": "wrong_base", "slot": attnzoo.Slot.QUERY}),
         "must subclass RowMapTransform"),
    ],
)
def test_register_validates_the_contract(bad, match):
    with pytest.warns(PluginWarning, match=match):
        reg = new_registry(entry_points=False,
                           extra_plugins=[("bad", plugin("bad", register_transforms=lambda register: register(bad)))])
    assert reg.plugins["bad"].errors


def test_misspelled_hook_is_reported_and_others_still_load():
    bad = types.ModuleType("typo")
    bad.register_transfroms = attnzoo.hookimpl(lambda register: None)
    with pytest.warns(PluginWarning, match=r"plugin 'typo'.*cannot register"):
        reg = new_registry(entry_points=False, extra_plugins=[("typo", bad)])
    assert "softcap" in reg.transforms


def test_hook_that_raises_is_reported():
    def boom(register):
        raise RuntimeError("kaboom")

    with pytest.warns(PluginWarning, match="register_transforms failed: RuntimeError: kaboom"):
        reg = new_registry(entry_points=False, extra_plugins=[("boom", plugin("boom", register_transforms=boom))])
    assert "vanilla" in reg.specs


def test_env_var_restricts_entry_point_plugins(monkeypatch):
    monkeypatch.setenv("ATTNZOO_PLUGINS", "none")
    assert "gate" not in new_registry().plugins
    monkeypatch.setenv("ATTNZOO_PLUGINS", "attnzoo-gate")
    assert "gate" in new_registry().plugins


def _fake_distribution(root: Path, module_source: str) -> None:
    (root / "broken_plugin.py").write_text(module_source)
    info = root / "broken_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[attnzoo]\nbroken = broken_plugin\n")


@pytest.mark.subprocess
def test_plugin_that_raises_on_import_is_reported_by_name(tmp_path):
    _fake_distribution(tmp_path, "raise ImportError('needs a GPU library that is not installed')\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "attnzoo.cli", "list", "--json"], capture_output=True, text=True,
                         env=env)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    broken = next(p for p in data["plugins"] if p["name"] == "broken")
    assert broken["package"] == "broken-plugin" and broken["version"] == "0.3"
    assert broken["errors"] == ["failed to load: ImportError: needs a GPU library that is not installed"]
    assert "softcap" in {t["kind"] for t in data["transforms"]}
    assert "sigmoid_output_gate" in {t["kind"] for t in data["transforms"]}  # the other plugin still works
    assert "plugin 'broken' (broken-plugin)" in run.stderr  # the warning names it
    table = subprocess.run([sys.executable, "-m", "attnzoo.cli", "list"], capture_output=True, text=True, env=env)
    assert "FAILED: failed to load: ImportError" in table.stdout


def test_concurrent_first_use_builds_one_registry(monkeypatch):
    from attnzoo import registry as module

    monkeypatch.setattr(module, "_default", module._default)  # teardown puts the default registry back
    module.reset_registry()
    built = []

    def slow_new_registry(**kwargs):
        built.append(1)
        time.sleep(0.2)  # long enough for every thread to find no registry yet, were there no lock
        return new_registry(entry_points=False)

    monkeypatch.setattr(module, "new_registry", slow_new_registry)
    barrier = threading.Barrier(8)
    found = [None] * 8

    def worker(i):
        barrier.wait()
        found[i] = module.get_registry()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1
    assert found[0] is not None and all(r is found[0] for r in found)


def test_a_registration_failure_lists_the_slots_is_named_by_the_spec_and_refuses_unimplemented_methods(tmp_path):
    class Rectified(attnzoo.LogitsTransform):
        kind = "rectified"
        slot = "probabilities"  # not a Slot

    with pytest.warns(PluginWarning, match=r"slot must be an attnzoo.Slot \(Slot.QUERY, .*Slot.PROBABILITY, "
                                           r"Slot.OUTPUT\), got 'probabilities'"):
        reg = isolated(("sp", plugin("sp", register_transforms=lambda register: register(Rectified))))
    with pytest.raises(attnzoo.SpecError) as caught:  # the spec says why the kind is unknown
        attnzoo.load_spec({"name": "s", "transforms": [{"kind": "rectified"}]}, registry=reg)
    message = str(caught.value)
    assert "unknown kind 'rectified'" in message and "failed to register" in message and "plugin 'sp'" in message
    assert "\n" not in message

    class Mapped(attnzoo.ProbabilityTransform):  # the probability slot exists: such a plugin registers
        kind = "rectified"
        slot = attnzoo.Slot.PROBABILITY

        def weights(self, logits, allowed, ctx, params):
            return torch.where(allowed, torch.relu(logits), 0.0)

    reg = isolated(("sp", plugin("sp", register_transforms=lambda register: register(Mapped))))
    assert reg.transforms["rectified"] is Mapped and not reg.errors()
    attnzoo.load_spec({"name": "s", "transforms": [{"kind": "rectified"}]}, registry=reg)

    class NoSink(attnzoo.NormaliserTransform):
        kind = "no_sink"
        slot = attnzoo.Slot.NORMALISER

    with pytest.warns(PluginWarning, match=r"transform 'no_sink': it does not implement sink\(\)"):
        reg = isolated(("ns", plugin("ns", register_transforms=lambda register: register(NoSink))))
    assert "no_sink" not in reg.transforms
