"""`attnzoo new-plugin NAME --kind map|evictor|transform` (issue 54, item 5): each template, written into a fresh
directory, passes its own tests as written: its formula tests and the conformance suite (reference and blocked,
float64 and float32, every shape). The plugin is loaded from the written files, as its entry point would load it,
into a registry that stands in for the process-wide one (tests/test_new_plugin.py installs the default template
with pip in a fresh environment, as a user does)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import attnzoo
from attnzoo import registry as registry_module
from attnzoo.cli import main
from attnzoo.scaffold import KINDS, names, scaffold


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["transform", "map", "evictor"])
def test_each_template_passes_its_own_tests_and_the_conformance_suite(tmp_path, monkeypatch, kind):
    name = f"my{kind}"
    n = names(name)
    root = scaffold(name, tmp_path, kind)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted([
        "README.md", "pyproject.toml", f"{n['module']}/__init__.py", f"{n['module']}/{name}.yaml",
        "tests/test_conformance.py", "tests/test_formulas.py"])
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, n["module"], raising=False)
    module = load(root / n["module"] / "__init__.py", n["module"])
    reg = attnzoo.new_registry(entry_points=False, extra_plugins=[(n["ident"], module)])
    reg.check_pending()
    monkeypatch.setattr(registry_module, "_default", reg)
    registered = {"transform": reg.transforms.get(n["scale"]), "map": reg.transforms.get(n["map"]),
                  "evictor": reg.evictors.get(n["evictor"])}[kind]
    assert registered is not None and name in reg.specs
    ran = []
    for test_file in ("test_formulas.py", "test_conformance.py"):
        tests = load(root / "tests" / test_file, f"{n['module']}_{test_file[:-3]}")
        for attr in sorted(dir(tests)):
            if attr.startswith("test_"):
                getattr(tests, attr)()
                ran.append(attr)
    assert "test_the_plugin_passes_the_conformance_suite" in ran and len(ran) >= 3, ran
    for module_name in [m for m in sys.modules if m.startswith(n["module"])]:
        monkeypatch.delitem(sys.modules, module_name)


def test_new_plugin_kind_on_the_command_line(tmp_path, capsys):
    assert main(["new-plugin", "keys", "--kind", "evictor", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "wrote " in out and "evictor keys_key_norm, spec keys, tests" in out
    assert (tmp_path / "attnzoo-keys" / "attnzoo_keys" / "keys.yaml").read_text().startswith("name: keys\n")
    with pytest.raises(SystemExit):
        main(["new-plugin", "other", "--kind", "backend", "--dir", str(tmp_path)])
    assert "invalid choice: 'backend'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--kind 'backend': choose one of all, transform, map, evictor"):
        scaffold("other", tmp_path, "backend")
    assert KINDS == ("all", "transform", "map", "evictor")
