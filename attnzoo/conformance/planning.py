"""What a conformance run plans, before any case runs: the specs and backends it covers (:func:`select`, with spec
files loaded by :func:`with_files`), the checks of one spec on one backend in one dtype in a profile
(:func:`planned`, with their flags and the function each calls), which of them do not apply to a spec whatever the
backend, a backend's decline of every mode, the shape/skip patterns, and the model of a case's seconds in Triton's
interpreter. :func:`attnzoo.conformance.runner.build_cases` turns these into cases.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from . import checks, checks_decode, checks_transform
from .vectors import VECTOR_DIR, cases_for


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
#: 2-core AMD EPYC (float32): checks without a shape. Differential shapes: :func:`interpreter_cost`. ``fast-step``:
#: the triton backend offers no fast decoding step, so the case is unsupported at once.
INTERPRETER_SECONDS = {"vectors": 0.3, "accumulated": 0.5, "decode": 3.5, "causality": 0.1, "batch-invariance": 0.15,
                       "evictor": 0.9, "evicted-decode": 2.5, "padded-decode": 2.3, "fast-step": 0.0,
                       "determinism": 0.3, "packed/outputs": 0.7, "packed/gradients": 2.7, "packed/prefill": 3.7,
                       "finite-differences": 0.0, "weights": 0.0,  # these run on the reference alone,
                       "map-blocks": 0.0}  # and this one on the blocked backend (CPU), once per spec
#: the interpreter's start (its first kernels), paid once per run
INTERPRETER_START_SECONDS = 1.5


def interpreter_cost(check: str, shape: checks.Shape | None, spec, dtype: torch.dtype) -> float:
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
class Planned:
    check: str
    flags: tuple[str, ...]
    fn: Callable
    args: tuple
    shape: checks.Shape | None = None


def planned(target: checks.Target, profile: str) -> list[Planned]:
    """The checks of one spec on one backend in one dtype, in the profile: float64 and float32 get every check
    (``finite-differences`` float64 only), float16 and bfloat16 outputs and gradients on :data:`checks.HALF_SHAPES`,
    ``accumulated`` and ``decode``."""
    half = target.dtype in checks.HALF
    out = []
    if (VECTOR_DIR / f"{target.spec.name}.json").exists() and not half:
        out += [Planned(f"vectors/{vc.id}", vc.flags, checks.check_vector, (vc,)) for vc in cases_for(target.spec)]
    wanted = checks.PROFILES[profile]
    for shape in checks.DIFFERENTIAL_SHAPES:
        if shape.id not in wanted or (half and shape.id not in checks.HALF_SHAPES):
            continue
        out.append(Planned(f"outputs/{shape.id}", _flags(shape), checks.check_differential, (shape, False), shape))
        out.append(Planned(f"gradients/{shape.id}", _flags(shape), checks.check_differential, (shape, True), shape))
    if target.dtype == torch.float64:  # the reference's gradients against its outputs: float64 only
        out.append(Planned("finite-differences", ("gradients",), checks_transform.check_finite_differences, ()))
    if not half and "probability" in target.spec.slots():  # only a spec with a probability map has weights
        out.append(Planned("weights", ("probability",), checks_transform.check_weights, ()))
        out.append(Planned("map-blocks", ("probability",), checks_transform.check_map_blocks, ()))
    out.append(Planned("accumulated", ("accumulator",), checks.check_accumulated, ()))
    out.append(Planned("decode", ("decode", "offset-positions"), checks_decode.check_decode, ()))
    if half:
        return out
    out += [Planned("causality", ("causality",), checks.check_causality, ()),
            Planned("batch-invariance", ("batch",), checks.check_batch_invariance, ()),
            Planned("evictor", ("eviction", "protected"), checks_decode.check_evictor, ()),
            Planned("evicted-decode", ("eviction", "decode"), checks_decode.check_evicted_decode, ()),
            Planned("padded-decode", ("eviction", "decode", "padding"), checks_decode.check_padded_decode, ()),
            Planned("fast-step", ("decode", "eviction"), checks_decode.check_fast_step, ()),
            Planned("determinism", ("determinism",), checks.check_determinism, ()),
            Planned("packed/outputs", ("packing",), checks.check_packed, (False,)),
            Planned("packed/gradients", ("packing",), checks.check_packed, (True,)),
            Planned("packed/prefill", ("packing", "decode", "eviction"), checks_decode.check_packed_prefill, ())]
    return out


def not_applicable(check: str, target: checks.Target) -> bool:
    """The check does not apply to the spec whatever the backend (it raises Unsupported before asking the backend):
    such a case is kept beside a declined spec's one case, with its own reason."""
    spec = target.spec
    if check == "accumulated":
        return "accumulator" not in spec.slots()
    if check == "evictor":
        return spec.cache is None
    if check in ("evicted-decode", "padded-decode"):
        return spec.cache is None or not spec.attention.causal
    if check in ("decode", "packed/prefill", "causality", "fast-step"):
        return not spec.attention.causal
    if check == "determinism":
        return not getattr(target.registry.backends[target.backend], "deterministic", True)
    return False


def declines_every_mode(target: checks.Target) -> tuple[str, bool] | None:
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


def matches_check(check: str, case_id: str, pattern: str) -> bool:
    """fnmatch on the check, its shape (after the ``/``) or the whole id; in the id, ``[float32]`` also matches
    literally (for fnmatch it is a set of characters)."""
    literal = pattern.replace("[", "[[]")
    return (fnmatch.fnmatchcase(check, pattern) or fnmatch.fnmatchcase(check.split("/", 1)[-1], pattern)
            or fnmatch.fnmatchcase(case_id, pattern) or fnmatch.fnmatchcase(case_id, literal))


def check_patterns(what: str, patterns: Iterable[str]) -> list[str]:
    patterns = list(patterns or ())
    for pattern in patterns:
        if not pattern.strip():
            raise ValueError(f"{what} pattern '{pattern}': an empty pattern matches no check (give a check, e.g. "
                             f"gradients/gqa-n63, a shape, e.g. gqa-n1030, or an fnmatch pattern, e.g. 'outputs/*')")
    return patterns
