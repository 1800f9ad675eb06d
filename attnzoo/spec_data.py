"""Spec files: a variant as validated, hashable data, checked against a given registry.

The public path is :mod:`attnzoo.spec` (which adds the default registry); this module sits below the registry, which
loads the specs plugins register through it (docs/architecture.md).

Files are YAML, TOML or JSON and load the same way, safely: a size limit, a nesting limit, YAML without object
tags or aliases (no alias bombs), duplicate keys rejected, invalid UTF-8 rejected, NaN/inf rejected. Every problem
raises :class:`SpecError` with one line: ``file: field.path: reason``.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Optional, Union

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, create_model, model_validator

from .errors import SpecError
from .transforms.base import COMPOSING_SLOTS, Slot, StrictModel

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
SUFFIXES = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml", ".json": "json"}
#: the longest key or value a message quotes from a file; longer ones are cut (a message never echoes a file)
EXCERPT = 40
#: the top-level keys of a spec; a file with none of them (nor a near miss) is not a spec and is not quoted at all
SPEC_KEYS = ("name", "summary", "attention", "transforms", "cache")


class AttentionOptions(StrictModel):
    causal: bool = True
    scale: float | None = Field(None, gt=0, description="logit scale; default 1/sqrt(head_dim)")


class SpecBase(StrictModel):
    """A validated spec. The concrete class (with the registry's transform union) comes from the registry."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$", max_length=64)
    summary: str = Field("", max_length=2000)
    attention: AttentionOptions = AttentionOptions()
    transforms: list[Any] = []
    cache: Any | None = None

    _transform_classes: ClassVar[dict[str, type]] = {}
    _evictor_classes: ClassVar[dict[str, type]] = {}
    _source: str = PrivateAttr("<mapping>")
    _hash: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _cross_checks(self):
        seen_slots: dict[str, int] = {}
        seen_kinds: set[str] = set()
        for index, entry in enumerate(self.transforms):
            cls = self._transform_classes[entry.kind]
            where = f"transforms[{index}]"
            if entry.kind in seen_kinds:
                raise ValueError(f"{where}: kind '{entry.kind}' appears twice")
            seen_kinds.add(entry.kind)
            if cls.slot not in COMPOSING_SLOTS and cls.slot.value in seen_slots:
                raise ValueError(
                    f"{where}: slot '{cls.slot.value}' already holds transforms[{seen_slots[cls.slot.value]}]"
                    " (one accumulator, one normaliser and one probability map per spec; row maps, logits and masks"
                    " compose in spec order)"
                )
            seen_slots.setdefault(cls.slot.value, index)
            problem = cls(entry).check_spec(self)
            if problem:
                raise ValueError(f"{where}: {problem}")
        mapped = seen_slots.get(Slot.PROBABILITY.value)
        if mapped is not None and Slot.NORMALISER.value in seen_slots:
            sink = seen_slots[Slot.NORMALISER.value]
            raise ValueError(
                f"transforms[{max(sink, mapped)}]: '{self.transforms[sink].kind}' (normaliser) adds a logit to the "
                f"softmax's denominator, and '{self.transforms[mapped].kind}' (probability) replaces the softmax: a "
                "normaliser needs the softmax")
        if self.cache is not None:
            evictor = self._evictor_classes[self.cache.evictor](self.cache)
            problem = evictor.check_spec(self)
            if problem:
                raise ValueError(f"cache: {problem}")
            if mapped is not None and evictor.needs_probabilities:
                raise ValueError(
                    f"cache: evictor '{evictor.kind}' ranks tokens by their softmax attention probabilities, and "
                    f"transforms[{mapped}] ('{self.transforms[mapped].kind}') replaces the softmax: its weights are "
                    "no probabilities to rank by")
            budget = self.cache.budget  # a fraction of the prompt is checked by the evictor once resolved
            problem = evictor.check_budget(budget) if budget is not None and not isinstance(budget, float) else None
            if problem:
                raise ValueError(f"cache.budget: {problem}")
        return self

    # -- identity ---------------------------------------------------------------------------------------------
    @property
    def source(self) -> str:
        return self._source

    def canonical_json(self) -> str:
        """The spec with every default filled in, keys sorted, no whitespace: the form that is hashed."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def function(self) -> dict[str, Any]:
        """What the spec computes, as JSON data: its fields without ``name`` and ``summary`` (two specs with equal
        functions differ only by what they are called and how they are described). The callers that compare
        specs by part of what they compute (the transforms outside some slots, the cache without its budget) take
        this and leave out the part themselves."""
        return self.model_dump(mode="json", exclude={"name", "summary"})

    @property
    def hash(self) -> str:
        """sha256 of the canonical JSON without ``summary`` (documentation does not change the function). Computed
        once: a spec is frozen (a decode cache is made, and its steps checked, against it at every step of a
        server's batch)."""
        if self._hash is None:
            data = self.model_dump(mode="json", exclude={"summary"})
            text = json.dumps(data, sort_keys=True, separators=(",", ":"))
            self._hash = hashlib.sha256(text.encode()).hexdigest()
        return self._hash

    def model_copy(self, *, update=None, deep: bool = False):
        """pydantic's copy; one with ``update`` hashes afresh (the copied hash would be the original's)."""
        copied = super().model_copy(update=update, deep=deep)
        if update:
            copied._hash = None  # noqa: SLF001 -- this class's own field on its copy
        return copied

    def slots(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for entry in self.transforms:
            out.setdefault(self._transform_classes[entry.kind].slot.value, []).append(entry)
        return out


def build_spec_model(transforms: dict[str, type], evictors: dict[str, type]) -> type[SpecBase]:
    """The spec model for a registry: ``transforms`` is a union on ``kind``, ``cache`` a union on ``evictor``."""
    t_arms = tuple(cls.options_model() for cls in transforms.values())
    e_arms = tuple(cls.options_model() for cls in evictors.values())
    t_type = _union(t_arms, "kind")
    e_type = _union(e_arms, "evictor")
    model = create_model(
        "Spec",
        __base__=SpecBase,
        transforms=(list[t_type], []) if t_type is not None else (list[Any], Field([], max_length=0)),
        cache=(Optional[e_type], None) if e_type is not None else (None, None),
    )
    model._transform_classes = dict(transforms)  # noqa: SLF001 -- SpecBase's class tables, set by its module
    model._evictor_classes = dict(evictors)  # noqa: SLF001
    return model


def _union(arms: tuple[type, ...], tag: str):
    if not arms:
        return None
    if len(arms) == 1:
        return arms[0]
    return Annotated[Union[arms], Field(discriminator=tag)]  # noqa: UP007 - a runtime tuple of arms


# -- loading ----------------------------------------------------------------------------------------------------
class _SpecYamlLoader(yaml.SafeLoader):
    """SafeLoader without aliases (alias bombs), with a nesting limit and duplicate-key detection."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.MarkedYAMLError(problem="YAML aliases are not allowed in spec files",
                                       problem_mark=event.start_mark)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise yaml.MarkedYAMLError(problem=f"nesting deeper than {MAX_DEPTH} levels",
                                       problem_mark=self.peek_event().start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:
                raise yaml.MarkedYAMLError(problem="mapping keys must be plain scalars",
                                           problem_mark=key_node.start_mark) from None
            if duplicate:
                raise yaml.MarkedYAMLError(problem=f"duplicate key {_quote(key)}", problem_mark=key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml(text: str, source: str) -> Any:
    try:
        loader = _SpecYamlLoader(text)  # a SafeLoader subclass: no object tags, no aliases
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.problem and exc.context and "constructor for the tag" not in exc.context:
            problem = f"{exc.context}, {exc.problem}"
        if "constructor for the tag" in problem:
            problem = f"tag {problem.split('tag', 1)[1].strip()} is not allowed (plain YAML only)"
        raise SpecError(source, f"{where}{' '.join(problem.split())}") from None
    except yaml.YAMLError as exc:
        raise SpecError(source, f"invalid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise SpecError(source, f"nesting deeper than {MAX_DEPTH} levels") from None


def _json(text: str, source: str) -> Any:
    def pairs(items):
        out = {}
        for key, value in items:
            if key in out:
                raise SpecError(source, f"duplicate key {_quote(key)}")
            out[key] = value
        return out

    try:  # NaN and Infinity parse to floats so that _check_tree rejects them with their field path
        return json.loads(text, object_pairs_hook=pairs, parse_constant=float)
    except json.JSONDecodeError as exc:
        raise SpecError(source, f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise SpecError(source, f"nesting deeper than {MAX_DEPTH} levels") from None


def _toml(text: str, source: str) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(source, f"invalid TOML: {exc}") from None
    except RecursionError:
        raise SpecError(source, f"nesting deeper than {MAX_DEPTH} levels") from None


def _check_tree(node: Any, source: str, depth: int = 0, path: str = "") -> None:
    if depth > MAX_DEPTH:
        raise SpecError(source, f"nesting deeper than {MAX_DEPTH} levels")
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                raise SpecError(source, f"keys must be strings, not {type(key).__name__} {key!r}", path)
            _check_tree(value, source, depth + 1, f"{path}.{_field(key)}" if path else _field(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_tree(value, source, depth + 1, f"{path}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise SpecError(source, f"{node} is not allowed (numbers must be finite)", path)


def read_spec_file(path: Path, source: str | None = None) -> dict[str, Any]:
    """Read and parse a spec file into plain data (not yet validated against the registry).

    ``source`` is how messages name the file (default ``str(path)``; load_spec passes the path as given).
    """
    path = Path(path)
    source = str(path) if source is None else source
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise SpecError(source, f"unknown file type '{path.suffix}' (use .yaml, .yml, .toml or .json)")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        raise SpecError(source, f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise SpecError(source, f"file is larger than the {MAX_BYTES // 1024} KiB limit for spec files")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(source, f"not valid UTF-8 (byte {exc.start})") from None
    try:
        data = {"yaml": _yaml, "json": _json, "toml": _toml}[kind](text, source)
    except SpecError:
        raise
    except ValueError as exc:  # e.g. an integer longer than int's 4300-digit limit
        raise SpecError(source, f"invalid {kind.upper()}: {' '.join(str(exc).split())}") from None
    if data is None:
        raise SpecError(source, "empty file (a spec is a mapping with at least 'name')")
    if not isinstance(data, dict):
        raise SpecError(source, f"the top level must be a mapping, not {type(data).__name__}")
    if not any(key in SPEC_KEYS or did_you_mean(key, SPEC_KEYS) for key in data if isinstance(key, str)):
        raise SpecError(source, f"not a spec file: its top level has none of the keys {', '.join(SPEC_KEYS)}")
    _check_tree(data, source)
    return data


def validate_spec_data(data: dict[str, Any], source: str, registry) -> SpecBase:
    """Validate plain data against ``registry``'s spec model."""
    model = registry.spec_model()
    try:
        spec = model.model_validate(data)
    except ValidationError as exc:
        error = _spec_error(exc, data, source, model)
        failed = _failed_registration(exc, registry)
        if failed:
            error = SpecError(source, f"{error.reason}; {failed}", error.path)
        raise error from None
    spec._source = source  # noqa: SLF001 -- SpecBase's own field, set by its module's loader
    return spec


def names_a_file(source: str | Path) -> bool:
    """Whether ``source`` is meant as a spec file rather than a registered spec's name, judged from its text alone.

    A :class:`~pathlib.Path`, a string with a path separator (``./selective``, ``specs/x``) or a string ending in a
    spec-file suffix (``.yaml``, ``.yml``, ``.toml``, ``.json``) names a file. A bare name (``selective``) names a
    registered spec first, whatever the working directory holds; see :func:`load_spec`.
    """
    if isinstance(source, Path):
        return True
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return any(sep in source for sep in seps) or Path(source).suffix.lower() in SUFFIXES


def load_spec(source: Any, registry) -> SpecBase:
    """A spec from a path (YAML, TOML or JSON), the name of a spec registered in ``registry``, a mapping, or a spec
    itself: :func:`attnzoo.spec.load_spec` with the registry given."""
    if isinstance(source, SpecBase):
        return source
    if isinstance(source, dict):
        return validate_spec_data(source, "<mapping>", registry)
    if not isinstance(source, (str, Path)):
        raise SpecError(repr(source), "expected a path, a spec name, a mapping or a Spec")
    as_file = names_a_file(source)
    if not as_file:  # a bare name: the registered spec wins over whatever the working directory holds
        if source in registry.specs:
            return registry.specs[source]
    path = Path(source)
    shown = _show(str(source)) if not str(source).isprintable() else str(source)
    try:
        exists, is_file = path.exists(), path.is_file()
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise SpecError(shown, f"cannot read: {exc.strerror or exc}") from None
    if as_file or exists:
        if not exists:
            raise SpecError(shown, "no such file")
        if not is_file:
            raise SpecError(shown, "not a regular file")
        return validate_spec_data(read_spec_file(path, shown), shown, registry)
    known = ", ".join(sorted(registry.specs)) or "none"
    raise SpecError(shown, f"no such file and no registered spec of that name{did_you_mean(shown, registry.specs)} "
                           f"(registered: {known})")


def did_you_mean(name: str, known) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``known`` to ``name``, or ``""``."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _failed_registration(exc: ValidationError, registry) -> str:
    """For an unknown transform kind that a plugin tried and failed to register: what the registry said of it."""
    for err in exc.errors():
        if err.get("type") != "union_tag_invalid":
            continue
        tag = str(err.get("ctx", {}).get("tag", ""))
        said = [e for e in registry.errors() if f"'{tag}'" in e]
        if tag and said:
            return f"it failed to register: {said[0]}"
    return ""


def _keys_at(loc: tuple, model: type | None) -> list[str] | None:
    """The keys the spec model accepts where the unknown key ``loc[-1]`` stands, or None if it cannot tell."""
    node = model
    items = list(loc[:-1])
    while items and node is not None:
        item = items.pop(0)
        field = node.model_fields.get(item) if isinstance(item, str) else None
        if field is None:
            return None
        annotation = field.annotation
        if item in ("transforms", "cache"):  # unions on kind / evictor: pydantic names the arm after the tag
            if item == "transforms":
                if not items or not isinstance(items[0], int):
                    return None
                items.pop(0)
            tag = items.pop(0) if items else None
            classes = model._transform_classes if item == "transforms" else model._evictor_classes  # noqa: SLF001
            node = classes[tag].options_model() if tag in classes else None
            continue
        node = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    if node is None:
        return None
    return sorted(f.alias or name for name, f in node.model_fields.items())


def _spec_error(exc: ValidationError, data: Any, source: str, model: type | None = None) -> SpecError:
    errors = exc.errors(include_url=False)
    # a misspelt key shows up twice (the key unknown, the intended one missing): name the misspelling first
    first = min(errors, key=lambda e: e["type"] not in ("extra_forbidden", "union_tag_invalid"))
    path = _format_loc(first["loc"], data)
    kind = first["type"]
    msg = " ".join(first["msg"].removeprefix("Value error, ").split())
    if kind == "extra_forbidden":
        keys = _keys_at(tuple(first["loc"]), model)
        key = first["loc"][-1]
        msg = "unknown key" + (f"{did_you_mean(key, keys)}; valid keys: {', '.join(keys)}" if keys else "")
    elif kind == "union_tag_invalid":
        ctx = first.get("ctx", {})
        tag = ctx.get("discriminator", "kind").strip(chr(39))
        expected = [t.strip().strip(chr(39)) for t in str(ctx.get("expected_tags", "")).split(",")]
        msg = (f"unknown {tag} {_quote(ctx.get('tag'))}{did_you_mean(ctx.get('tag'), expected)} "
               f"(known: {ctx.get('expected_tags')})")
    elif kind == "union_tag_not_found":
        msg = f"missing {first.get('ctx', {}).get('discriminator', 'kind')}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return SpecError(source, msg, path)


def _format_loc(loc: tuple, data: Any) -> str:
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            node = node[item] if isinstance(node, list) and item < len(node) else None
            continue
        if isinstance(node, dict) and item not in node and item in (node.get("kind"), node.get("evictor")):
            continue  # the union arm pydantic names after the tag value
        parts.append(f".{_field(item)}" if parts else _field(item))
        node = node.get(item) if isinstance(node, dict) else None
    return "".join(parts)


def _show(value: Any) -> str:
    """A name or path quoted for a one-line message: ``'name'``, with escapes for newlines and control characters."""
    return repr(value)


def _quote(value: Any) -> str:
    """A key or value from a file, quoted like :func:`_show` and cut after :data:`EXCERPT` characters: a message
    quotes a spec's fields, never a file's contents at length."""
    if isinstance(value, str) and len(value) > EXCERPT:
        return repr(value[:EXCERPT]) + "..."
    return repr(value)


def _field(key: Any) -> str:
    """A mapping key as a segment of a field path: as written when printable and short, else quoted with escapes
    (and cut after :data:`EXCERPT` characters)."""
    key = str(key)
    return key if key.isprintable() and key and len(key) <= EXCERPT else _quote(key)
