"""Enumerate conformance cases (spec × backend × dtype × check), run them, and report.

Test ids look like ``reference::selective::vectors/decode-tie[float32]``. An expected-failures file lists ids (or
fnmatch patterns), one per line, ``#`` starts a comment; entries that match no case produce a warning.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import platform
import stat
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import checks
from .vectors import VECTOR_DIR, cases_for

DEFAULT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
#: Specs shipped with attnzoo: a named backend may decline one of these without failing the run.
BUILTIN_SPECS = "attnzoo.builtin_specs"


@dataclass
class Case:
    id: str
    spec: str
    backend: str
    dtype: str
    check: str
    flags: tuple[str, ...]
    run: Callable[[], None] = field(repr=False, compare=False)
    #: a decline of the spec itself fails the case (the user named this backend and the spec is a plugin's)
    decline_fails: bool = False


@dataclass
class Result:
    id: str
    spec: str
    backend: str
    dtype: str
    check: str
    status: str  # pass | fail | unsupported | xfail | xpass
    message: str = ""
    seconds: float = 0.0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def with_files(registry, specs: Iterable[str] | None) -> list[str] | None:
    """``specs`` with every spec file among them (``attnzoo.spec.names_a_file``) loaded and registered in
    ``registry`` under its name (origin ``file <path>``), so that the suite runs it like a registered spec.
    Raises ValueError when a file's spec has the name of a different registered spec."""
    from ..errors import SpecError
    from ..spec import load_spec, names_a_file

    if not specs:
        return None
    names = []
    for source in specs:
        if not names_a_file(source):
            names.append(source)
            continue
        try:
            spec = load_spec(source, registry=registry)
        except SpecError as exc:
            raise ValueError(str(exc)) from None
        known = registry.specs.get(spec.name)
        if known is not None and known.hash != spec.hash:
            raise ValueError(f"{source}: spec '{spec.name}' is already registered (by "
                             f"'{registry.origin[('specs', spec.name)]}') with other contents: rename it")
        if known is None:
            registry.specs[spec.name] = spec
            registry.origin[("specs", spec.name)] = f"file {source}"
        names.append(spec.name)
    return names


def select(registry, specs: Iterable[str] | None = None, backends: Iterable[str] | None = None,
           plugin: str | None = None) -> tuple[list[str], list[str]]:
    """The specs and backends a run covers. ``plugin`` (a distribution or plugin name) narrows to what that
    plugin registered: its specs and the specs using its transforms, on its backends (or all backends)."""
    spec_names = list(specs) if specs else sorted(registry.specs)
    backend_names = list(backends) if backends else sorted(registry.backends)
    if plugin:
        owners = {p.name for p in registry.plugins.values() if plugin in (p.name, p.package)}
        if not owners:
            raise ValueError(f"no loaded plugin is named '{plugin}' (loaded: "
                             f"{', '.join(sorted({p.package for p in registry.plugins.values()}))})")
        kinds = {k for k in registry.transforms if registry.origin[("transforms", k)] in owners}
        if not specs:
            spec_names = [s for s in spec_names if registry.origin[("specs", s)] in owners
                          or any(t.kind in kinds for t in registry.specs[s].transforms)]
        owned = [b for b in backend_names if registry.origin[("backends", b)] in owners]
        if owned and not backends:
            backend_names = owned
    from ..spec import did_you_mean

    for name in spec_names:
        if name not in registry.specs:
            raise ValueError(f"unknown spec '{name}'{did_you_mean(name, registry.specs)} (registered: "
                             f"{', '.join(sorted(registry.specs))}; or give a spec file)")
    for name in backend_names:
        if name not in registry.backends:
            raise ValueError(f"unknown backend '{name}'{did_you_mean(name, registry.backends)} (registered: "
                             f"{', '.join(sorted(registry.backends))})")
    return spec_names, backend_names


def _add_case(cases: list[Case], target: checks.Target, decline_fails: bool, check: str, flags: tuple[str, ...],
              fn: Callable, *args) -> None:
    dtype = _dtype_name(target.dtype)
    cases.append(Case(f"{target.backend}::{target.spec.name}::{check}[{dtype}]", target.spec.name, target.backend,
                      dtype, check, flags, functools.partial(fn, target, *args), decline_fails))


def _flags(shape: checks.Shape) -> tuple[str, ...]:
    flags = ("masked-row",) if shape.masked_rows else ()
    if shape.offset:
        flags += ("offset-positions", "gqa")
    if shape.length >= 1000:
        flags += ("long",)
    return flags or ("odd-length",)


def build_cases(registry, specs=None, backends=None, dtypes=DEFAULT_DTYPES, plugin=None, seed=0,
                device: str = "cpu") -> list[Case]:
    """Every case of a run. float64 and float32 get every check; float16 and bfloat16 (for backends that claim
    them) a smaller set: outputs and gradients on :data:`checks.HALF_SHAPES`, ``return_accumulated`` and decoding.
    ``specs``, ``backends`` and ``plugin`` are what the user named (None: all); when ``backends`` are named, a
    backend that declines a plugin's spec outright fails (docs/conformance.md)."""
    spec_names, backend_names = select(registry, specs, backends, plugin)
    cases = []
    for backend in backend_names:
        for spec_name in spec_names:
            spec = registry.specs[spec_name]
            decline_fails = bool(backends) and registry.origin[("specs", spec_name)] != BUILTIN_SPECS
            for dtype in dtypes:
                target = checks.Target(spec, backend, dtype, registry, seed, device)
                add = functools.partial(_add_case, cases, target, decline_fails)
                half = dtype in checks.HALF
                if (VECTOR_DIR / f"{spec_name}.json").exists() and not half:
                    for vc in cases_for(spec):
                        add(f"vectors/{vc.id}", vc.flags, checks.check_vector, vc)
                for shape in checks.DIFFERENTIAL_SHAPES:
                    if half and shape.id not in checks.HALF_SHAPES:
                        continue
                    add(f"outputs/{shape.id}", _flags(shape), checks.check_differential, shape, False)
                    add(f"gradients/{shape.id}", _flags(shape), checks.check_differential, shape, True)
                add("accumulated", ("accumulator",), checks.check_accumulated)
                add("decode", ("decode", "offset-positions"), checks.check_decode)
                if half:
                    continue
                add("causality", ("causality",), checks.check_causality)
                add("batch-invariance", ("batch",), checks.check_batch_invariance)
                add("evictor", ("eviction", "protected"), checks.check_evictor)
                add("determinism", ("determinism",), checks.check_determinism)
                add("packed/outputs", ("packing",), checks.check_packed, False)
                add("packed/gradients", ("packing",), checks.check_packed, True)
                add("packed/prefill", ("packing", "decode", "eviction"), checks.check_packed_prefill)
    return cases


#: the largest expected-failures file read (a list of test ids is kilobytes)
MAX_EXPECTED_BYTES = 1 << 20


def read_expected_failures(path: str | Path | None) -> list[str]:
    """The test ids (or fnmatch patterns) listed in ``path``, one per line, ``#`` comments dropped. Only a regular
    file of at most :data:`MAX_EXPECTED_BYTES` is read (never a device, pipe or folder, which could block or never
    end); anything else raises ValueError with one line."""
    if path is None:
        return []
    try:  # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then refuses it
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file (an expected-failures file lists test ids)")
        chunks, size = [], 0
        while size <= MAX_EXPECTED_BYTES and (chunk := os.read(fd, MAX_EXPECTED_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        raw = b"".join(chunks)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_EXPECTED_BYTES:
        raise ValueError(f"{path}: larger than {MAX_EXPECTED_BYTES >> 20} MiB, not an expected-failures list")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    entries = []
    for line in text.splitlines():
        entry = line.split("#", 1)[0].strip()
        if entry:
            entries.append(entry)
    return entries


def run_case(case: Case, expected_failure: bool = False) -> Result:
    start = time.perf_counter()
    status, message = "pass", ""
    try:
        case.run()
    except checks.Declined as exc:
        status, message = "unsupported", str(exc)
        if case.decline_fails and exc.spec_level:
            status = "fail"
            message = (f"backend '{case.backend}' declines spec '{case.spec}', which was named for it: {exc} "
                       f"(list it in an expected-failures file if that is intended)")
    except checks.Unsupported as exc:
        status, message = "unsupported", str(exc)
    except AssertionError as exc:
        status, message = "fail", " ".join(str(exc).split()) or "assertion failed"
    except Exception as exc:  # a crash inside a backend is a failure of that backend, reported in one line
        status, message = "fail", f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if expected_failure:
        status = {"fail": "xfail", "pass": "xpass"}.get(status, status)
        if status == "xpass":
            message = "unexpectedly passed: remove it from the expected-failures file"
    return Result(case.id, case.spec, case.backend, case.dtype, case.check, status, message,
                  time.perf_counter() - start)


def matches(case_id: str, entries: list[str]) -> list[str]:
    return [e for e in entries if case_id == e or fnmatch.fnmatchcase(case_id, e)]


def run_suite(cases: list[Case], expected_failures: list[str] = (), progress=None) -> list[Result]:
    used: set[str] = set()
    results = []
    for case in cases:
        hit = matches(case.id, list(expected_failures))
        used.update(hit)
        results.append(run_case(case, bool(hit)))
        if progress is not None:
            progress(results[-1])
    for entry in expected_failures:
        if entry not in used:
            warnings.warn(f"expected-failures entry matches no test: {entry}", UserWarning, stacklevel=2)
    return results


def header(registry, specs, backends, dtypes, device: str = "cpu") -> dict:
    import attnzoo

    return {
        "device": device,
        "attnzoo": attnzoo.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "backends": {b: registry.origin[("backends", b)] for b in backends},
        "specs": {s: registry.specs[s].hash[:12] for s in specs},
        "dtypes": [_dtype_name(d) for d in dtypes],
        "plugins": [{"name": p.name, "package": p.package, "version": p.version, "errors": p.errors}
                    for p in registry.plugins.values()],
    }


def failed(results: list[Result]) -> bool:
    """A check failed, an expected failure passed, or nothing was checked at all (every case unsupported)."""
    return any(r.status in ("fail", "xpass") for r in results) or not checked(results)


def checked(results: list[Result]) -> bool:
    return any(r.status in ("pass", "xfail") for r in results)


def matrix(results: list[Result]) -> dict[str, dict[str, str]]:
    """spec -> backend -> 'pass (n)' / 'FAIL k/n: first failure' / 'unsupported: reason'."""
    cells: dict[str, dict[str, list[Result]]] = {}
    for r in results:
        cells.setdefault(r.spec, {}).setdefault(r.backend, []).append(r)
    out: dict[str, dict[str, str]] = {}
    for spec, row in cells.items():
        for backend, rs in row.items():
            bad = [r for r in rs if r.status in ("fail", "xpass")]
            ran = [r for r in rs if r.status != "unsupported"]
            xfail = sum(r.status == "xfail" for r in rs)
            if bad:
                text = f"FAIL {len(bad)}/{len(ran)}: {bad[0].check}[{bad[0].dtype}]: {bad[0].message}"
            elif not ran:
                reasons = sorted({r.message for r in rs})
                text = f"unsupported: {reasons[0]}"
            else:
                text = f"pass ({len(ran) - xfail}" + (f", {xfail} xfail" if xfail else "") + ")"
                skipped = len(rs) - len(ran)
                if skipped:
                    text += f", {skipped} n/a"
            out.setdefault(spec, {})[backend] = text
    return out


def to_markdown(head: dict, results: list[Result]) -> str:
    table = matrix(results)
    backends = list(head["backends"])
    lines = [f"# attnzoo conformance: attnzoo {head['attnzoo']}, torch {head['torch']}, python {head['python']}", "",
             f"dtypes: {', '.join(head['dtypes'])}; plugins: "
             + ", ".join(f"{p['package']} {p['version']}" for p in head["plugins"] if p["package"] != "attnzoo"), "",
             "| spec | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for spec in head["specs"]:
        row = table.get(spec, {})
        lines.append(f"| {spec} | " + " | ".join(row.get(b, "-").replace("|", "\\|") for b in backends) + " |")
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "unsupported", "xfail", "xpass")}
    lines += ["", ", ".join(f"{v} {k}" for k, v in counts.items())]
    return "\n".join(lines) + "\n"


def to_json(head: dict, results: list[Result]) -> str:
    return json.dumps({"header": head, "matrix": matrix(results), "results": [asdict(r) for r in results]},
                      indent=1)
