"""Installing attnzoo registers a pytest plugin (``pytest11``); an unrelated pytest run must not pay for torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.subprocess


def test_pytest_plugin_imports_nothing_heavy(tmp_path):
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        import sys

        def test_probe(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("attnzoo"), "attnzoo's plugin is not registered"
            heavy = sorted(m for m in ("torch", "attnzoo.registry", "attnzoo.conformance.runner", "pydantic")
                           if m in sys.modules)
            assert not heavy, f"imported at collection: {heavy}"
    """))
    # the plugin as the installed entry point registers it (make install: pip install -e)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_lazy_package_names_resolve():
    code = ("import sys, attnzoo as zt; assert 'torch' not in sys.modules; "
            "missing = [n for n in zt.__all__ if getattr(zt, n, None) is None]; assert not missing, missing; "
            "assert zt.Spec is __import__('attnzoo.spec', fromlist=['SpecBase']).SpecBase; "
            "assert set(zt.__all__) == {*zt._LAZY, '__version__'}; "
            "import attnzoo.conformance as c; assert set(c.__all__) == set(c._LAZY); "
            "assert all(getattr(c, n) is not None for n in c.__all__); print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", "import attnzoo; attnzoo.nonexistent"], capture_output=True,
                         text=True, timeout=60)
    assert "has no attribute 'nonexistent'" in bad.stderr
