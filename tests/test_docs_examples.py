"""Every Python example in the docs (docs/*.md and the README) runs, page by page in order in one namespace, in
a temporary directory holding the repository's ``specs``, after the prelude the docs state in docs/index.md
(``import torch`` and ``import attnzoo``). A block preceded by ``<!-- no-run: reason -->`` is skipped, and the
reason must be given."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"(<!-- no-run(?P<why>[^>]*)-->\s*)?```python\n(?P<code>.*?)```", re.S)


def _pages_with_examples():
    return [p for p in PAGES if BLOCK.search(p.read_text())]


@pytest.mark.parametrize("page", _pages_with_examples(), ids=lambda p: p.name)
def test_examples_run(page, tmp_path, monkeypatch):
    pytest.importorskip("transformers") if page.name in ("transformers.md", "README.md") else None
    monkeypatch.chdir(tmp_path)
    os.symlink(ROOT / "attnzoo" / "specs", tmp_path / "specs")
    namespace = {"__name__": f"docs_example_{page.stem}"}
    exec("import torch\nimport attnzoo\ntorch.manual_seed(0)", namespace)
    for index, match in enumerate(BLOCK.finditer(page.read_text())):
        if match.group(1):
            assert match.group("why").strip(": "), f"{page.name} example {index}: no-run needs a reason"
            continue
        code = compile(match.group("code"), f"{page.name}[example {index}]", "exec")
        exec(code, namespace)
