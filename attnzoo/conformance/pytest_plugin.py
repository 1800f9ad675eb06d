"""pytest plugin (entry point ``pytest11``): ``pytest --attnzoo-conformance`` adds one test per conformance case.

Options: ``--attnzoo-spec``, ``--attnzoo-backend``, ``--attnzoo-dtype`` (repeatable), ``--attnzoo-plugin DIST``,
``--attnzoo-expected-failures FILE``, ``--attnzoo-seed``, ``--attnzoo-device`` (the device of the backend under
test, e.g. ``cuda``; the reference always runs on CPU), ``--attnzoo-quick`` (the quick profile),
``--attnzoo-shape PATTERN`` / ``--attnzoo-skip PATTERN`` (repeatable: keep or drop cases by check or shape). Without
``--attnzoo-conformance`` it does nothing and imports nothing heavy.

The items are collected like any other (``pytest_collectreport``), so ``--collect-only`` and the summary count them,
and ``-k`` / ``-m`` deselect among them.
"""

from __future__ import annotations

import warnings

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("attnzoo", "attnzoo conformance suite")
    group.addoption("--attnzoo-conformance", action="store_true", help="run the attnzoo conformance suite")
    group.addoption("--attnzoo-spec", action="append", default=None, help="spec name to test (repeatable)")
    group.addoption("--attnzoo-backend", action="append", default=None, help="backend to test (repeatable)")
    group.addoption("--attnzoo-dtype", action="append", default=None, help="dtype to test (repeatable)")
    group.addoption("--attnzoo-plugin", default=None, help="only what this plugin registered")
    group.addoption("--attnzoo-expected-failures", default=None, help="file of test ids expected to fail")
    group.addoption("--attnzoo-seed", type=int, default=0, help="seed of the fresh random inputs")
    group.addoption("--attnzoo-device", default="cpu", help="device of the backend under test (default cpu)")
    group.addoption("--attnzoo-quick", action="store_true",
                    help="the quick profile: every check on three small shapes, not N = 1,030")
    group.addoption("--attnzoo-shape", action="append", default=None, metavar="PATTERN",
                    help="only cases whose check (gradients/gqa-n63), shape (gqa-n63) or id matches (repeatable)")
    group.addoption("--attnzoo-skip", action="append", default=None, metavar="PATTERN",
                    help="leave out cases whose check, shape or id matches (repeatable)")


def _enabled(config) -> bool:
    return bool(config.getoption("--attnzoo-conformance"))


def _selection(config):
    import torch

    from ..registry import get_registry
    from . import planning, runner

    reg = get_registry()
    dtypes = []
    for name in config.getoption("--attnzoo-dtype") or ():
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise ValueError(f"--attnzoo-dtype: unknown floating dtype '{name}' (e.g. float32, float64)")
        dtypes.append(value)
    specs, backends = planning.select(reg, planning.with_files(reg, config.getoption("--attnzoo-spec")),
                                      config.getoption("--attnzoo-backend"), config.getoption("--attnzoo-plugin"))
    return reg, specs, backends, tuple(dtypes) or runner.DEFAULT_DTYPES


_CASES = pytest.StashKey[list]()


def _cases(config) -> list:
    """The cases of the run, built once (pytest_configure) and kept for the header and the collection."""
    if _CASES not in config.stash:
        from . import runner

        reg, specs, _, dtypes = _selection(config)
        names = specs if config.getoption("--attnzoo-spec") else None
        config.stash[_CASES] = runner.build_cases(
            reg, names, config.getoption("--attnzoo-backend"), dtypes, plugin=config.getoption("--attnzoo-plugin"),
            seed=config.getoption("--attnzoo-seed"), device=config.getoption("--attnzoo-device"),
            profile="quick" if config.getoption("--attnzoo-quick") else "full",
            shapes=config.getoption("--attnzoo-shape") or (), skip=config.getoption("--attnzoo-skip") or ())
    return config.stash[_CASES]


def pytest_configure(config):
    """Bad options stop the run here, with one line and exit code 2 (pytest would report an internal error)."""
    if not _enabled(config):
        return
    from . import runner

    try:
        _selection(config)
        _cases(config)
        runner.read_expected_failures(config.getoption("--attnzoo-expected-failures"))
    except ValueError as exc:
        pytest.exit(f"attnzoo conformance: {' '.join(str(exc).split())}", returncode=2)


def pytest_report_header(config):
    if not _enabled(config):
        return None
    from . import runner

    reg, specs, backends, dtypes = _selection(config)
    head = runner.header(reg, specs, backends, dtypes)
    plugins = ", ".join(f"{p['package']} {p['version']}" for p in head["plugins"] if p["package"] != "attnzoo")
    lines = [f"attnzoo conformance: attnzoo {head['attnzoo']}, torch {head['torch']}, python {head['python']}",
             f"  backends: {', '.join(backends)}; dtypes: {', '.join(head['dtypes'])}; plugins: {plugins or 'none'}",
             f"  specs: {', '.join(specs)}; profile: {'quick' if config.getoption('--attnzoo-quick') else 'full'}"]
    cases = _cases(config)
    if runner.interpreted(backends) and runner.estimate(cases):
        lines.append(f"  estimate: about {runner.duration(runner.estimate(cases))} for the "
                     f"{sum(c.backend == 'triton' for c in cases)} triton cases in Triton's interpreter (a model of "
                     f"per-case costs measured on a 2-core AMD EPYC; -k deselects, --attnzoo-quick checks fewer "
                     f"shapes)")
    return lines


class ConformanceItem(pytest.Item):
    def __init__(self, *, case, **kwargs):
        super().__init__(**kwargs)
        self.case = case

    def runtest(self):
        from .runner import run_case

        result = run_case(self.case)
        if result.status == "unsupported":
            pytest.skip(f"unsupported: {result.message}")
        if result.status == "fail":
            raise AssertionError(result.message)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, AssertionError):
            return f"{self.case.id}: {excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self):
        return "attnzoo-conformance", None, self.case.id


class ConformanceCollector(pytest.Collector):
    def collect(self):
        from . import runner

        config = self.config
        expected = runner.read_expected_failures(config.getoption("--attnzoo-expected-failures"))
        used: set[str] = set()
        items = []
        for case in _cases(config):
            item = ConformanceItem.from_parent(self, name=case.id, case=case)
            hit = runner.matches(case.id, expected)
            if hit:
                used.update(hit)
                item.add_marker(pytest.mark.xfail(strict=True, reason=f"expected failure: {hit[0]}"))
            items.append(item)
        for entry in expected:
            if entry not in used:
                warnings.warn(f"attnzoo expected-failures entry matches no test: {entry}", UserWarning, stacklevel=1)
        return items


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """Before -k/-m deselect: the conformance items, collected through the session (genitems reports them, so
    ``collected N items`` and ``--collect-only`` count them)."""
    if not _enabled(config):
        return
    collector = ConformanceCollector.from_parent(session, name="attnzoo-conformance")
    items.extend(session.genitems(collector))
