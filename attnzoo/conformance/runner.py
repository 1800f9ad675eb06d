"""Enumerate conformance cases (spec × backend × dtype × check), run them, and report. What each case checks is
planned in :mod:`.planning`; the checks themselves are in :mod:`.checks` and :mod:`.checks_decode`.

Test ids look like ``reference::selective::vectors/decode-tie[float32]``. An expected-failures file lists ids (or
fnmatch patterns), one per line, ``#`` starts a comment; entries that match no case produce a warning.

Profiles (``profile=``): ``full`` (every shape) and ``quick`` (:data:`checks.QUICK_SHAPES`: every check, on fewer and
smaller shapes). ``shapes=`` / ``skip=`` keep or drop cases by fnmatch patterns on the check part of the id
(``gradients/gqa-n1030``), its shape alone (``gqa-n1030``) or the whole id.
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
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import checks, planning
from .frames import plugin_frame
from .planning import ALL_CHECKS

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
    #: modelled seconds of this case in Triton's interpreter (:func:`estimate`; 0 for a declined case)
    cost: float = 0.0


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


def _declined(message: str, spec_level: bool) -> None:
    raise checks.Declined(message, spec_level)


def build_cases(registry, specs=None, backends=None, dtypes=DEFAULT_DTYPES, plugin=None, seed=0,
                device: str = "cpu", profile: str = "full", shapes: Iterable[str] = (),
                skip: Iterable[str] = ()) -> list[Case]:
    """Every case of a run. float64 and float32 get every check; float16 and bfloat16 (for backends that claim
    them) a smaller set: outputs and gradients on :data:`checks.HALF_SHAPES`, ``return_accumulated`` and decoding.
    ``specs``, ``backends`` and ``plugin`` are what the user named (None: all); when ``backends`` are named, a
    backend that declines a plugin's spec outright fails (docs/conformance.md).

    ``profile``: ``"full"`` (default) or ``"quick"`` (:data:`checks.QUICK_SHAPES`, every check). ``shapes``: keep only
    the cases whose check (``gradients/gqa-n63``), shape (``gqa-n63``) or whole id matches one of these fnmatch
    patterns; ``skip``: drop those that match one. A pattern that matches no case raises ValueError.

    A backend that declines every mode (forward, backward, decode) of a spec in a dtype gets one case for it,
    ``<backend>::<spec>::all-checks[<dtype>]``, with the reasons, not one per check (beside it, the checks that do
    not apply to the spec at all, with their own reason)."""
    if profile not in checks.PROFILES:
        raise ValueError(f"unknown conformance profile '{profile}' (profiles: {', '.join(checks.PROFILES)})")
    shapes = planning.check_patterns("shape", shapes)
    skip = planning.check_patterns("skip", skip)
    spec_names, backend_names = planning.select(registry, specs, backends, plugin)
    cases: list[Case] = []
    used: set[tuple[str, str]] = set()
    every: dict[str, None] = {}  # the checks before filtering, for the message of a pattern that matches none
    planned_any = False
    first_cost = planning.INTERPRETER_START_SECONDS
    for backend in backend_names:
        for spec_name in spec_names:
            spec = registry.specs[spec_name]
            decline_fails = bool(backends) and registry.origin[("specs", spec_name)] != BUILTIN_SPECS
            for dtype in dtypes:
                target = checks.Target(spec, backend, dtype, registry, seed, device)
                name = _dtype_name(dtype)
                kept = []
                for item in planning.planned(target, profile):
                    planned_any = True
                    every["vectors/*" if item.check.startswith("vectors/") else item.check] = None
                    case_id = f"{backend}::{spec_name}::{item.check}[{name}]"
                    hit = [p for p in shapes if planning.matches_check(item.check, case_id, p)]
                    dropped = [p for p in skip if planning.matches_check(item.check, case_id, p)]
                    used.update(("shape", p) for p in hit)
                    used.update(("skip", p) for p in dropped)
                    if (shapes and not hit) or dropped:
                        continue
                    kept.append(item)
                if not kept:
                    continue
                declined = planning.declines_every_mode(target)
                if declined is not None:
                    reasons, spec_level = declined
                    message = f"{reasons} (every mode in {name}: {len(kept)} checks)"
                    cases.append(Case(f"{backend}::{spec_name}::{ALL_CHECKS}[{name}]", spec_name, backend, name,
                                      ALL_CHECKS, ("declined",), functools.partial(_declined, message, spec_level),
                                      decline_fails))
                    kept = [item for item in kept if planning.not_applicable(item.check, target)]
                for item in kept:
                    cost = planning.interpreter_cost(item.check, item.shape, spec, dtype) if declined is None else 0.0
                    if backend == "triton" and cost:
                        cost, first_cost = cost + first_cost, 0.0
                    cases.append(Case(f"{backend}::{spec_name}::{item.check}[{name}]", spec_name, backend, name,
                                      item.check, item.flags, functools.partial(item.fn, target, *item.args),
                                      decline_fails, cost))
    checks_text = ", ".join(every)
    for what, patterns in (("shape", shapes), ("skip", skip)):
        for pattern in patterns:
            if planned_any and (what, pattern) not in used:
                raise ValueError(f"{what} pattern '{pattern}' matches no check of this run (profile {profile}: "
                                 f"{checks_text}; or a whole test id)")
    if planned_any and not cases:
        raise ValueError(f"the shape/skip patterns leave no case to run (profile {profile}: {checks_text})")
    return cases


def interpreted(backends: Iterable[str]) -> bool:
    """The triton backend is under test in Triton's interpreter (TRITON_INTERPRET=1): minutes, not seconds."""
    return "triton" in list(backends) and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def estimate(cases: Iterable[Case]) -> float:
    """Estimated seconds of the triton cases in Triton's interpreter, from :func:`.planning.interpreter_cost`'s model
    (measured on one CPU: scale it by what the first cases take here; the other backends' cases take seconds and are
    not counted)."""
    return sum(c.cost for c in cases if c.backend == "triton")


def duration(seconds: float) -> str:
    """``40 s``, ``3.5 min``."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


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
        raised = plugin_frame(exc, innermost_only=True)
        if raised:  # a plugin's own assert, not a check's verdict
            message = f"{type(exc).__name__}: {message} (raised at {raised})"
    except Exception as exc:  # a crash inside a backend is a failure of that backend, reported in one line
        status, message = "fail", f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        raised = plugin_frame(exc)
        if raised:
            message += f" (raised at {raised})"
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


STATUSES = ("pass", "fail", "unsupported", "xfail", "xpass")


def summary(results: list[Result]) -> list[str]:
    """Two lines: the counts (they add up to the cases run), then the verdict, which says what :func:`failed` says:
    failures first; "nothing was checked" only when no case failed and none passed."""
    counts = Counter(r.status for r in results)
    lines = [f"{len(results)} case{'s' if len(results) != 1 else ''}: "
             + ", ".join(f"{counts[s]} {s}" for s in STATUSES)]
    bad = counts["fail"] + counts["xpass"]
    if bad:
        parts = [f"{counts['fail']} failed"] if counts["fail"] else []
        if counts["xpass"]:
            parts.append(f"{counts['xpass']} expected failure{'s' if counts['xpass'] != 1 else ''} passed")
        lines.append(f"FAILED: {', '.join(parts)}")
    elif not results:
        lines.append("nothing was checked: no case to run")
    elif not checked(results):
        lines.append("nothing was checked: every case was unsupported (see the reasons above)")
    else:
        lines.append(f"ok: {counts['pass']} passed"
                     + (f", {counts['xfail']} failed as expected" if counts["xfail"] else "")
                     + (f", {counts['unsupported']} unsupported (declined or not applicable)"
                        if counts["unsupported"] else ""))
    return lines


def failure_lines(results: list[Result]) -> list[str]:
    """One line per failure (``FAIL <id with its dtype>: <message>``); failures of one spec, backend and dtype with
    the same message (a decline) are one line naming the other checks."""
    groups: dict[tuple, list[Result]] = {}
    for r in results:
        if r.status in ("fail", "xpass"):
            groups.setdefault((r.status, r.backend, r.spec, r.dtype, r.message), []).append(r)
    lines = []
    for (status, *_, message), rs in groups.items():
        more = ""
        if len(rs) > 1:
            others = [r.check for r in rs[1:]]
            more = (f" (and {len(others)} more with this message: {', '.join(others[:6])}"
                    + (", ..." if len(others) > 6 else "") + ")")
        lines.append(f"{status.upper()} {rs[0].id}{more}: {message}")
    return lines


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
            elif not ran:  # the backend's own decline first, else the most frequent reason
                declined = [r.message for r in rs if r.check == ALL_CHECKS]
                counts = Counter(r.message for r in rs)
                text = f"unsupported: {declined[0] if declined else max(sorted(counts), key=counts.__getitem__)}"
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
    lines += ["", *summary(results)]
    return "\n".join(lines) + "\n"


def to_json(head: dict, results: list[Result]) -> str:
    return json.dumps({"header": head, "matrix": matrix(results), "results": [asdict(r) for r in results]},
                      indent=1)
