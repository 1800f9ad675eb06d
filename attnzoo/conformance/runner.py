"""Enumerate conformance cases (spec × backend × dtype × check), run them, and report.

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

from . import checks
from .frames import plugin_frame
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


#: The check a backend's decline of every mode in a dtype stands for: one case per spec and dtype, not one per check.
ALL_CHECKS = "all-checks"

#: Seconds per case in Triton's interpreter (TRITON_INTERPRET=1) for a spec without an accumulator, measured on a
#: 2-core AMD EPYC (float32): checks without a shape. Differential shapes: :func:`_interpreter_cost`.
INTERPRETER_SECONDS = {"vectors": 0.3, "accumulated": 0.5, "decode": 3.5, "causality": 0.1, "batch-invariance": 0.15,
                       "evictor": 0.9, "evicted-decode": 2.5, "determinism": 0.3, "packed/outputs": 0.7,
                       "packed/gradients": 2.7, "packed/prefill": 3.7}
#: the interpreter's start (its first kernels), paid once per run
INTERPRETER_START_SECONDS = 1.5


def _interpreter_cost(check: str, shape: checks.Shape | None, spec, dtype: torch.dtype) -> float:
    """A rough model of a case's seconds in Triton's interpreter: a differential shape costs in proportion to
    B x H x N^2 (the blocks the interpreter steps through), about 2.4 times more with gradients; the other checks come
    from :data:`INTERPRETER_SECONDS`. A spec with an accumulator (F) costs about 2.5 times more, half precision 1.3."""
    if shape is not None:
        work = shape.batch * shape.heads * shape.length ** 2
        seconds = 0.4 + 7.3e-6 * work if check.startswith("gradients/") else 0.1 + 3.0e-6 * work
    else:
        seconds = INTERPRETER_SECONDS.get("vectors" if check.startswith("vectors/") else check, 0.5)
    if "accumulator" in spec.slots():
        seconds *= 2.5
    if dtype in checks.HALF:
        seconds *= 1.3
    return seconds


def _flags(shape: checks.Shape) -> tuple[str, ...]:
    flags = ("masked-row",) if shape.masked_rows else ()
    if shape.offset:
        flags += ("offset-positions", "gqa")
    if shape.length >= 1000:
        flags += ("long",)
    return flags or ("odd-length",)


@dataclass
class _Planned:
    check: str
    flags: tuple[str, ...]
    fn: Callable
    args: tuple
    shape: checks.Shape | None = None


def _planned(target: checks.Target, profile: str) -> list[_Planned]:
    """The checks of one spec on one backend in one dtype, in the profile: float64 and float32 get every check,
    float16 and bfloat16 outputs and gradients on :data:`checks.HALF_SHAPES`, ``accumulated`` and ``decode``."""
    half = target.dtype in checks.HALF
    out = []
    if (VECTOR_DIR / f"{target.spec.name}.json").exists() and not half:
        out += [_Planned(f"vectors/{vc.id}", vc.flags, checks.check_vector, (vc,)) for vc in cases_for(target.spec)]
    wanted = checks.PROFILES[profile]
    for shape in checks.DIFFERENTIAL_SHAPES:
        if shape.id not in wanted or (half and shape.id not in checks.HALF_SHAPES):
            continue
        out.append(_Planned(f"outputs/{shape.id}", _flags(shape), checks.check_differential, (shape, False), shape))
        out.append(_Planned(f"gradients/{shape.id}", _flags(shape), checks.check_differential, (shape, True), shape))
    out.append(_Planned("accumulated", ("accumulator",), checks.check_accumulated, ()))
    out.append(_Planned("decode", ("decode", "offset-positions"), checks.check_decode, ()))
    if half:
        return out
    out += [_Planned("causality", ("causality",), checks.check_causality, ()),
            _Planned("batch-invariance", ("batch",), checks.check_batch_invariance, ()),
            _Planned("evictor", ("eviction", "protected"), checks.check_evictor, ()),
            _Planned("evicted-decode", ("eviction", "decode"), checks.check_evicted_decode, ()),
            _Planned("determinism", ("determinism",), checks.check_determinism, ()),
            _Planned("packed/outputs", ("packing",), checks.check_packed, (False,)),
            _Planned("packed/gradients", ("packing",), checks.check_packed, (True,)),
            _Planned("packed/prefill", ("packing", "decode", "eviction"), checks.check_packed_prefill, ())]
    return out


def _not_applicable(check: str, target: checks.Target) -> bool:
    """The check does not apply to the spec whatever the backend (it raises Unsupported before asking the backend):
    such a case is kept beside a declined spec's one case, with its own reason."""
    spec = target.spec
    if check == "accumulated":
        return "accumulator" not in spec.slots()
    if check == "evictor":
        return spec.cache is None
    if check == "evicted-decode":
        return spec.cache is None or not spec.attention.causal
    if check in ("decode", "packed/prefill", "causality"):
        return not spec.attention.causal
    if check == "determinism":
        return not getattr(target.registry.backends[target.backend], "deterministic", True)
    return False


def _declines_every_mode(target: checks.Target) -> tuple[str, bool] | None:
    """(reasons, spec_level) when the backend declines forward, backward and decode in the target's dtype (so every
    check of the spec would be declined, each with the same reasons); None when it takes one of them, or when asking
    it raised (the cases then run one by one and report what happens)."""
    from ..backends.base import Mode

    try:
        backend = target.registry.backends[target.backend]
        plan = target.variant().plan
        device = torch.device(target.device)
        verdicts = [backend.verdict(plan, device, target.dtype, mode) for mode in Mode]
        if not all(verdicts):
            return None
        spec_level = bool(backend.verdict(plan, device, torch.float32, Mode.FORWARD))
    except Exception:
        return None
    reasons = list(dict.fromkeys(r for v in verdicts for r in v))
    return "; ".join(reasons), spec_level


def _declined(message: str, spec_level: bool) -> None:
    raise checks.Declined(message, spec_level)


def _matches_check(check: str, case_id: str, pattern: str) -> bool:
    """fnmatch on the check, its shape (after the ``/``) or the whole id; in the id, ``[float32]`` also matches
    literally (for fnmatch it is a set of characters)."""
    literal = pattern.replace("[", "[[]")
    return (fnmatch.fnmatchcase(check, pattern) or fnmatch.fnmatchcase(check.split("/", 1)[-1], pattern)
            or fnmatch.fnmatchcase(case_id, pattern) or fnmatch.fnmatchcase(case_id, literal))


def _check_patterns(what: str, patterns: Iterable[str]) -> list[str]:
    patterns = list(patterns or ())
    for pattern in patterns:
        if not pattern.strip():
            raise ValueError(f"{what} pattern '{pattern}': an empty pattern matches no check (give a check, e.g. "
                             f"gradients/gqa-n63, a shape, e.g. gqa-n1030, or an fnmatch pattern, e.g. 'outputs/*')")
    return patterns


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
    shapes = _check_patterns("shape", shapes)
    skip = _check_patterns("skip", skip)
    spec_names, backend_names = select(registry, specs, backends, plugin)
    cases: list[Case] = []
    used: set[tuple[str, str]] = set()
    every: dict[str, None] = {}  # the checks before filtering, for the message of a pattern that matches none
    planned_any = False
    first_cost = INTERPRETER_START_SECONDS
    for backend in backend_names:
        for spec_name in spec_names:
            spec = registry.specs[spec_name]
            decline_fails = bool(backends) and registry.origin[("specs", spec_name)] != BUILTIN_SPECS
            for dtype in dtypes:
                target = checks.Target(spec, backend, dtype, registry, seed, device)
                name = _dtype_name(dtype)
                kept = []
                for item in _planned(target, profile):
                    planned_any = True
                    every["vectors/*" if item.check.startswith("vectors/") else item.check] = None
                    case_id = f"{backend}::{spec_name}::{item.check}[{name}]"
                    hit = [p for p in shapes if _matches_check(item.check, case_id, p)]
                    dropped = [p for p in skip if _matches_check(item.check, case_id, p)]
                    used.update(("shape", p) for p in hit)
                    used.update(("skip", p) for p in dropped)
                    if (shapes and not hit) or dropped:
                        continue
                    kept.append(item)
                if not kept:
                    continue
                declined = _declines_every_mode(target)
                if declined is not None:
                    reasons, spec_level = declined
                    message = f"{reasons} (every mode in {name}: {len(kept)} checks)"
                    cases.append(Case(f"{backend}::{spec_name}::{ALL_CHECKS}[{name}]", spec_name, backend, name,
                                      ALL_CHECKS, ("declined",), functools.partial(_declined, message, spec_level),
                                      decline_fails))
                    kept = [item for item in kept if _not_applicable(item.check, target)]
                for item in kept:
                    cost = _interpreter_cost(item.check, item.shape, spec, dtype) if declined is None else 0.0
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
    """Estimated seconds of the triton cases in Triton's interpreter, from :func:`_interpreter_cost`'s model (measured
    on one CPU: scale it by what the first cases take here; the other backends' cases take seconds and are not
    counted)."""
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
