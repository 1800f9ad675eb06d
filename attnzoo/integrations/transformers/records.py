"""The attnzoo record of a checkpoint (``config.attnzoo`` in ``config.json``, as :func:`~.core.apply` writes it and
``save_pretrained`` saves it), read the same way by every host: ``zt.from_pretrained`` and
``zt.load_transform_params``, the vLLM plugin and the ``attnzoo native-spec`` command (docs/transformers.md).

:func:`check_record` is the one reader: a record is a JSON object with known keys only (:data:`RECORD_KEYS`), each
of its type; its spec is an embedded spec or the name of a spec registered here (never a path), loads, and hashes to
the recorded hash; its budget, backend and prefer are values :func:`~.core.apply` accepts (a budget may be a
fraction of the prompt, a float in (0, 1]). Anything else is refused with one line naming the ``config.json`` and
the field, with every value it quotes clipped."""

from __future__ import annotations

import re
from typing import Any

from .base import CONFIG_KEY, PREFER, CheckpointSpecMismatchError, IntegrationError

#: The keys of a record, as :func:`~.core.apply` writes them; ``spec`` and ``hash`` are required.
RECORD_KEYS = ("spec", "name", "hash", "budget", "backend", "prefer")
#: The defaults of the optional keys.
RECORD_DEFAULTS = {"budget": None, "backend": "auto", "prefer": "error"}
_HEX = re.compile(r"^[0-9a-f]{64}$")


def clip(value: Any, limit: int = 80) -> str:
    """``value`` (as ``str``) on one line, cut to ``limit`` characters with an ellipsis: what a message quotes of
    a record."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def recorded_spec(record: dict, where) -> object:
    """The spec a checkpoint's ``config.attnzoo`` record names: the embedded spec (a mapping, as :func:`apply` writes
    it) or the name of a spec registered here. Never a path: a checkpoint is input, and a config that named a file
    on the loading machine would have attnzoo read (and quote) that file."""
    from ...registry import get_registry
    from ...spec import names_a_file

    spec = record.get("spec")
    if isinstance(spec, dict):
        return spec
    if isinstance(spec, str) and not names_a_file(spec) and spec in get_registry().specs:
        return spec
    what = "a path" if isinstance(spec, str) and names_a_file(spec) else (
        "a name no plugin registers here" if isinstance(spec, str) else f"a {_type(spec)}")
    raise IntegrationError(f"{where}: {CONFIG_KEY}.spec is {what}; a checkpoint names an embedded spec record (as "
                           f"save_pretrained writes it) or a registered spec, never a file")


def check_record(record: Any, where: str) -> dict:
    """The record ``record`` (the value of ``config.json``'s ``attnzoo`` key) checked and normalised: ``{"spec": the
    embedded spec or registered name, "name", "hash", "budget", "backend", "prefer"}`` (absent optional keys at
    their defaults, :data:`RECORD_DEFAULTS`). ``where``: the ``config.json`` it comes from, named by every refusal.

    Raises :class:`IntegrationError` with one line naming ``where`` and the field (``attnzoo.<key>``) for a record
    that is not an object, an unknown or missing key, a value of the wrong type, a spec that is a path, an unknown
    name or not a valid spec, a name other than the spec's, or a budget, backend or prefer that ``apply`` would
    refuse; :class:`CheckpointSpecMismatchError` (an ``IntegrationError``) for a spec that does not hash to the
    recorded hash (the spec was edited after saving, or a transform or plugin here changed its defaults)."""
    from ...errors import SpecError
    from ...evictors.base import budget_problem
    from ...registry import get_registry
    from ...spec import load_spec

    field = f"{where}: {CONFIG_KEY}"
    if not isinstance(record, dict):
        raise IntegrationError(f"{field}: a record is a JSON object with spec and hash (as save_pretrained writes "
                               f"it), got {_type(record)}")
    unknown = [key for key in record if key not in RECORD_KEYS]
    if unknown:
        raise IntegrationError(f"{field}.{clip(unknown[0], 40)}: unknown key (a record has {', '.join(RECORD_KEYS)})")
    for key in ("spec", "hash"):
        if key not in record:
            raise IntegrationError(f"{field}.{key}: missing (a record has spec and hash, as save_pretrained writes "
                                   f"them)")
    saved = record["hash"]
    if not isinstance(saved, str) or not _HEX.match(saved):
        shown = f"'{clip(saved, 24)}'" if isinstance(saved, str) else _type(saved)
        raise IntegrationError(f"{field}.hash: the spec's sha-256 (64 hex digits), got {shown}")
    if not isinstance(record["spec"], (dict, str)):
        raise IntegrationError(f"{field}.spec: an embedded spec (an object) or a registered spec's name, got "
                               f"{_type(record['spec'])}")
    name = record.get("name")
    if "name" in record and not isinstance(name, str):
        raise IntegrationError(f"{field}.name: a str (the spec's name), got {_type(name)}")
    budget = record.get("budget", RECORD_DEFAULTS["budget"])
    values = budget if isinstance(budget, list) else [budget]
    if (isinstance(budget, list) and not budget) or any(budget_problem(v) for v in values):
        shown = f"a list of {len(budget)}" if isinstance(budget, list) and not budget else clip(repr(budget), 40)
        raise IntegrationError(f"{field}.budget: an int >= 1, a float in (0, 1] (a fraction of the prompt), null, or "
                               f"a list of them (one per layer), got {shown}")
    backend = record.get("backend", RECORD_DEFAULTS["backend"])
    if not isinstance(backend, str):
        raise IntegrationError(f"{field}.backend: a str ('auto' or a backend's name), got {_type(backend)}")
    backends = get_registry().backends
    if backend != "auto" and backend not in backends:
        raise IntegrationError(f"{field}.backend: '{clip(backend, 40)}' is not a backend registered here (auto, "
                               f"{', '.join(sorted(backends))})")
    prefer = record.get("prefer", RECORD_DEFAULTS["prefer"])
    if not isinstance(prefer, str) or prefer not in PREFER:
        shown = f"'{clip(prefer, 40)}'" if isinstance(prefer, str) else _type(prefer)
        raise IntegrationError(f"{field}.prefer: one of {', '.join(PREFER)}, got {shown}")
    source = recorded_spec(record, where)
    try:
        spec = load_spec(source)
    except SpecError as exc:
        path = f".{exc.path}" if exc.path else ""
        raise IntegrationError(f"{field}.spec{path}: {clip(exc.reason, 300)}") from None
    if spec.hash != saved:
        raise CheckpointSpecMismatchError(
            f"{field}.hash: the recorded spec '{spec.name}' hashes to {spec.hash[:12]} here but was saved as "
            f"{saved[:12]} (the spec was edited after saving, or a transform or plugin changed its defaults)")
    if name is not None and name != spec.name:
        raise IntegrationError(f"{field}.name: '{clip(name, 64)}', but the recorded spec is named '{spec.name}'")
    return {"spec": source, "name": spec.name, "hash": saved, "budget": list(budget) if isinstance(budget, list)
            else budget, "backend": backend, "prefer": prefer}


def read_record(config_file: str, *, required: bool = True) -> dict | None:
    """The checked record (:func:`check_record`) of the ``config.json`` at ``config_file``; without an ``attnzoo``
    key: None, or (``required``) one line saying the checkpoint was not saved after ``apply()``. A file that is not
    a JSON object is refused in one line too."""
    import json

    try:
        with open(config_file, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise IntegrationError(f"{config_file}: not readable JSON ({clip(exc, 200)})") from None
    if not isinstance(data, dict):
        raise IntegrationError(f"{config_file}: not a JSON object (a transformers config.json is one)")
    if CONFIG_KEY not in data:
        if not required:
            return None
        raise IntegrationError(f"{config_file}: records no attnzoo spec (the checkpoint was not saved after apply()); "
                               f"load it with transformers and call apply(model, spec)")
    return check_record(data[CONFIG_KEY], config_file)
