"""The documentation site: a strict mkdocs build (broken links, anchors and references fail it), reference pages
generated from the code, and meta-tests on what the docs must cover."""

import inspect
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import attnzoo
from attnzoo import hookspecs
from attnzoo.registry import new_registry

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings")
sys.path.insert(0, str(ROOT / "docs"))
import hooks  # noqa: E402 - docs/hooks.py, the mkdocs hooks that generate the reference pages

pytestmark = pytest.mark.release


def test_the_site_builds_strictly(tmp_path):
    # the families page sweeps three families here (an exact, a refused, one transformers cannot build), not all
    # of them (minutes): tests/integrations/transformers/test_hf_sweep.py checks every one
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "ATTNZOO_DOCS_SWEEP": "llama,bloom,dbrx"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for page in ("reference/catalogue", "reference/spec-schema", "reference/support", "reference/api",
                 "reference/families", "plugin-tutorial"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_a_new_transform_appears_in_the_catalogue_without_editing_docs(monkeypatch):
    class Doubler(attnzoo.LogitsTransform):
        kind, slot, summary = "doubler_for_docs", attnzoo.Slot.LOGITS, "l' = 2 l"

        def apply(self, logits, ctx, params):
            return 2 * logits

    module = types.ModuleType("docs_plugin")
    module.register_transforms = attnzoo.hookimpl(lambda register: register(Doubler))
    reg = new_registry(entry_points=False, extra_plugins=[("docs_plugin", module)])
    monkeypatch.setattr(attnzoo, "get_registry", lambda: reg)
    assert "| `doubler_for_docs` | l' = 2 l | none | none | docs_plugin |" in hooks.catalogue()
    assert "doubler_for_docs" in hooks.spec_schema()


def test_every_registered_transform_evictor_and_spec_is_in_the_generated_pages():
    reg = attnzoo.get_registry()
    catalogue, support = hooks.catalogue(), hooks.support()
    for kind in [*reg.transforms, *reg.evictors]:
        assert f"| `{kind}` |" in catalogue, kind
    for name in reg.specs:
        assert f"| `{name}` |" in support, name


def test_every_hook_is_documented_with_its_exact_signature():
    text = (ROOT / "docs" / "plugins.md").read_text()
    hooks_declared = [n for n, f in vars(hookspecs).items() if n.startswith("register_") and callable(f)]
    assert hooks_declared
    for name in hooks_declared:
        assert f"`{name}{inspect.signature(getattr(hookspecs, name))}`" in text, name


def test_every_public_name_has_a_docstring_and_an_api_entry():
    api = hooks.api()
    for name in attnzoo.__all__:
        if name.startswith("_"):
            continue
        obj = getattr(attnzoo, name)
        doc = obj.__doc__ if isinstance(obj, (type, types.FunctionType, types.ModuleType)) or callable(obj) else "-"
        assert doc and doc.strip(), name
        assert f"::: attnzoo.{name}" in api


def test_docs_point_inside_the_repository():
    for page in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        assert "../shared" not in page.read_text(), page.name
