"""Checkpoints of applied models: the spec recorded in ``config.json`` and in every safetensors file, every tensor
of the attnzoo cores (the transforms' parameters and the token projections) restored from safetensors (never
pickles), and a ``config.json`` that plain transformers refuses to load rather than build the model without its spec
(docs/transformers.md). The record is read by :func:`~.records.check_record`, as every host reads it."""

from __future__ import annotations

import json
import os
import warnings

import torch

from .base import (
    CONFIG_KEY,
    CORE_MARK,
    UNSET,
    CheckpointSpecMismatchError,
    FunctionWarning,
    IntegrationError,
    is_applied,
    is_core_key,
)
from .core import apply
from .records import check_record, read_record
from .records import recorded_spec as recorded_spec  # where it was first defined
from .saving import METADATA_HASH, METADATA_NAME, METADATA_SPEC, SaveWithSpec, guard_config, stamp_safetensors  # noqa: F401

_MISSING = object()
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def from_pretrained(path_or_name, *, budget=UNSET, backend: str | None = None, **kwargs):
    """Load a checkpoint saved after :func:`apply`: its record checked first (:func:`~.records.check_record`, one
    line naming ``config.json`` and the field), then ``AutoModelForCausalLM.from_pretrained(path_or_name,
    **kwargs)``, the recorded spec applied again and every tensor of the attnzoo cores restored from the checkpoint's
    safetensors files (:func:`load_transform_params`). ``budget``/``backend`` override the recorded ones."""
    from transformers import AutoModelForCausalLM

    hub_kwargs = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config_file = _config_file(path_or_name, hub_kwargs)
    loader = AutoModelForCausalLM
    if config_file is not None:  # refused before transformers reads any weight
        read_record(config_file)
        loader = causal_lm_class(config_file, kwargs.get("config"))
    kwargs.setdefault("attn_implementation", "eager")  # the guard's name in config.json; apply() switches to attnzoo
    model = _quietly(lambda: loader.from_pretrained(path_or_name, **kwargs))
    where = config_file or f"{path_or_name} (its config)"
    record = getattr(model.config, CONFIG_KEY, _MISSING)
    if record is _MISSING:
        raise IntegrationError(f"{where}: records no attnzoo spec (the checkpoint was not saved after apply()); load "
                               f"it with transformers and call apply(model, spec)")
    record = check_record(record, where)  # the config the model was built with (``config=`` may be the caller's)
    with warnings.catch_warnings():  # the weights were saved with the spec (a fine-tune's, say): apply() compares
        warnings.simplefilter("ignore", FunctionWarning)  # the spec with attention these weights never ran with
        apply(model, record["spec"], budget=record["budget"] if budget is UNSET else budget,
              backend=backend or record["backend"], prefer=record["prefer"])
    load_transform_params(model, path_or_name, **hub_kwargs)
    return model


def causal_lm_class(config_file: str, config=None):
    """The class that loads a checkpoint: ``AutoModelForCausalLM``, or, where transformers' causal-LM mapping does
    not list the configuration class the checkpoint was saved with, the causal-LM class its ``architectures`` name.
    Emu3's ``Emu3ForCausalLM`` saves an ``Emu3TextConfig`` (``emu3_text_model``), which ``AutoModelForCausalLM``
    refuses ("Unrecognized configuration class"; plain transformers cannot load the checkpoint either): it loads
    through ``Emu3ForCausalLM``. Only a class transformers itself ships as a causal LM, built from exactly that
    configuration class, is taken (``architectures`` is the checkpoint's word); anything else is refused in one line
    naming transformers' limit."""
    import transformers
    from transformers import AutoModelForCausalLM, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from .saving import ARCHITECTURE_PREFIX

    try:
        with open(config_file, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RecursionError):
        return AutoModelForCausalLM  # read_record has read it: transformers says what is wrong
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if isinstance(config, PretrainedConfig):
        config_class = type(config)
    elif isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        config_class = CONFIG_MAPPING[model_type]
    else:  # remote code, or a model type this transformers does not know: its own refusal says so
        return AutoModelForCausalLM
    if config_class in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    names = data.get("architectures") if isinstance(data.get("architectures"), list) else []
    for name in names:
        if not isinstance(name, str):
            continue
        own = name[len(ARCHITECTURE_PREFIX):] if name.startswith(ARCHITECTURE_PREFIX) else name
        cls = getattr(transformers, own, None) if own in causal else None
        if isinstance(cls, type) and getattr(cls, "config_class", None) is config_class:
            return cls
    raise IntegrationError(f"{config_file}: transformers {transformers.__version__} has no causal LM for the "
                           f"configuration class {config_class.__name__} ({_clip_name(model_type)}): "
                           f"AutoModelForCausalLM does not list it (plain transformers cannot load this checkpoint "
                           f"either) and its architectures ({_clip_name(names)}) name no transformers causal-LM class "
                           f"built from it")


def _clip_name(value, limit: int = 80) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _config_file(path_or_name, hub_kwargs: dict) -> str | None:
    """The ``config.json`` of a checkpoint directory or hub name (None when there is none: transformers says so)."""
    try:
        return _resolve(path_or_name, "config.json", hub_kwargs)
    except Exception:  # noqa: BLE001 - transformers' own load reports what is wrong with the name
        return None


class _OnlyCoreKeys:
    """A logging filter: drops transformers' load report when every key it lists is a tensor of an attnzoo core
    (:data:`~.base.CORE_MARK`: transform parameters, token projections)."""

    def filter(self, record) -> bool:
        message = record.getMessage()
        if "LOAD REPORT" not in message:
            return True
        rows = [line for line in message.splitlines()[2:] if "|" in line and line.strip("-+| ")]
        return not rows or not all(CORE_MARK in row for row in rows)


#: The loggers transformers writes its load report with (a filter there holds for every handler the record reaches,
#: the root logger's too when transformers propagates, as it does under CI).
_REPORT_LOGGERS = ("transformers.modeling_utils", "transformers.modeling_layers", "transformers.utils.loading_report")


def _quietly(load):
    """Run a transformers load without its report when the report lists only tensors of the attnzoo cores as
    unexpected keys (they are restored right after by :func:`load_transform_params`, which refuses missing or extra
    ones). A report that lists anything else is shown whole."""
    import logging

    drop = _OnlyCoreKeys()
    targets = [logging.getLogger(name) for name in _REPORT_LOGGERS] + list(logging.getLogger("transformers").handlers)
    for target in targets:
        target.addFilter(drop)
    try:
        return load()
    finally:
        for target in targets:
            target.removeFilter(drop)


def _resolve(path_or_name, filename: str, hub_kwargs: dict) -> str | None:
    base = os.fspath(path_or_name)
    local = os.path.join(base, hub_kwargs.get("subfolder") or "", filename)
    if os.path.isdir(base):
        return local if os.path.isfile(local) else None
    from transformers.utils import cached_file

    return cached_file(base, filename, _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **hub_kwargs)


def _checkpoint_files(path_or_name, hub_kwargs: dict) -> tuple[str, list[str]]:
    """(config.json, safetensors files) of a checkpoint directory, hub name, or one ``.safetensors`` file."""
    path = os.fspath(path_or_name)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise IntegrationError(f"{path}: not a .safetensors file or a checkpoint directory (attnzoo reads "
                                   f"parameters only from safetensors, never from pickles)")
        config = os.path.join(os.path.dirname(path) or ".", "config.json")
        if not os.path.isfile(config):
            raise IntegrationError(f"{path}: no config.json beside it to say which spec it was saved with")
        return config, [path]
    config = _resolve(path, "config.json", hub_kwargs)
    if config is None:
        raise IntegrationError(f"{path}: no config.json (not a transformers checkpoint)")
    index = _resolve(path, "model.safetensors.index.json", hub_kwargs)
    if index is not None:
        with open(index, encoding="utf-8") as fh:
            names = sorted(set(json.load(fh).get("weight_map", {}).values()))
        files = [_resolve(path, name, hub_kwargs) for name in names]
        missing = [n for n, f in zip(names, files, strict=True) if f is None]
        if missing:
            raise IntegrationError(f"{index}: lists {missing[0]}, which is missing")
        return config, files
    single = _resolve(path, "model.safetensors", hub_kwargs)
    if single is None:
        raise IntegrationError(f"{path}: no model.safetensors (attnzoo reads parameters only from safetensors, never "
                               f"from pickles such as pytorch_model.bin)")
    return config, [single]


def core_state(model) -> dict[str, torch.Tensor]:
    """Every tensor of the attnzoo cores in ``model``'s state dict (:func:`~.base.is_core_key`: the transforms'
    parameters, the token projections' weights and biases, anything else a core owns), by state-dict key; the
    parameters themselves (``keep_vars``), so that copying into them restores the model."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if is_core_key(k)}


def load_transform_params(model, path_or_name, **hub_kwargs) -> list[str]:
    """Copy every tensor of the attnzoo cores in a checkpoint (directory, hub name or ``.safetensors`` file, read
    with ``safetensors``) into ``model``, which :func:`apply` has prepared: the transforms' parameters and the token
    projections (:func:`core_state`). Refuses with one line, naming the file: a record that :func:`check_record`
    refuses, a checkpoint saved with another spec (both hashes), a tensor missing from it, one the model does not
    have, or a shape that differs. Returns the state-dict keys loaded."""
    from safetensors import safe_open

    mine = getattr(model.config, CONFIG_KEY, None) if is_applied(model) else None
    if mine is None:
        raise IntegrationError(f"{type(model).__name__}: call apply(model, spec) before loading transform parameters")
    config_file, files = _checkpoint_files(path_or_name, hub_kwargs)
    theirs = read_record(config_file)
    if theirs["hash"] != mine["hash"]:
        raise CheckpointSpecMismatchError(
            f"{config_file}: checkpoint saved with spec '{theirs.get('name')}' (hash {str(theirs['hash'])[:12]}), "
            f"the model uses spec '{mine['name']}' (hash {mine['hash'][:12]})")
    wanted = core_state(model)
    found: dict[str, tuple[str, str]] = {}  # checkpoint key -> (file, key)
    for file in files:
        with safe_open(file, framework="pt") as fh:
            for key in fh.keys():
                if is_core_key(key):
                    found[key] = (file, key)
    mapping = _match_keys(list(wanted), list(found), getattr(model, "base_model_prefix", ""))
    shown = files[0] if len(files) == 1 else os.path.dirname(files[0])
    missing = [k for k in wanted if k not in mapping]
    if missing:
        raise IntegrationError(f"{shown}: holds no value for {len(missing)} attnzoo parameter(s) of the model "
                               f"(first: {missing[0]})")
    extra = sorted(set(found) - set(mapping.values()))
    if extra:
        raise IntegrationError(f"{shown}: holds {len(extra)} attnzoo parameter(s) the model does not have (first: "
                               f"{extra[0]})")
    for file in files:
        check_stamp(file, mine)
    tensors = {}
    for key, source in mapping.items():
        file, name = found[source]
        with safe_open(file, framework="pt") as fh:
            value = fh.get_tensor(name)
        if tuple(value.shape) != tuple(wanted[key].shape):
            raise IntegrationError(f"{file}: {name} has shape {tuple(value.shape)}, the model's "
                                   f"{key} has {tuple(wanted[key].shape)}")
        tensors[key] = value
    with torch.no_grad():
        for key, value in tensors.items():
            wanted[key].copy_(value)
    return sorted(tensors)


def check_stamp(file: str, mine: dict) -> None:
    """Refuse a safetensors file whose spec stamp (:func:`stamp_safetensors`) disagrees with the model's spec record
    ``mine``: the hash, the name, or the embedded spec itself (compared as canonical JSON, and hashed again so that
    a stamp cannot pair a true hash with another spec). A file without a stamp (saved by plain transformers, or
    sharded by another tool) is accepted on the config's record alone."""
    from safetensors import safe_open

    with safe_open(file, framework="pt") as fh:
        meta = fh.metadata() or {}
    stamped = meta.get(METADATA_HASH)
    if stamped is None and METADATA_SPEC not in meta:
        return
    saved = f"weights saved with spec '{str(meta.get(METADATA_NAME))[:64]}' (hash {str(stamped)[:12]})"
    ours = f"the model uses spec '{mine['name']}' (hash {mine['hash'][:12]})"
    if stamped != mine["hash"] or meta.get(METADATA_NAME, mine["name"]) != mine["name"]:
        raise CheckpointSpecMismatchError(f"{file}: {saved}, {ours}")
    try:
        spec = json.loads(meta.get(METADATA_SPEC, "null"))
    except (json.JSONDecodeError, RecursionError):
        raise CheckpointSpecMismatchError(f"{file}: its {METADATA_SPEC} metadata is not JSON") from None
    if spec is None:
        raise CheckpointSpecMismatchError(f"{file}: stamped with a spec hash but no {METADATA_SPEC} metadata")
    canonical = json.dumps(spec, sort_keys=True)
    if canonical != json.dumps(mine["spec"], sort_keys=True):
        from ...spec import load_spec

        try:
            rehashed = load_spec(spec).hash if isinstance(spec, dict) else "not a spec"
        except Exception:  # noqa: BLE001 - any refusal means the stamp does not describe the model's spec
            rehashed = "not a valid spec"
        raise CheckpointSpecMismatchError(f"{file}: its embedded spec ({rehashed[:12]}) is not the spec its hash "
                                          f"and config.json name; {ours}")


def _match_keys(wanted: list[str], found: list[str], prefix: str) -> dict[str, str]:
    """Model key -> checkpoint key: the same key, or the same without/with the base model's prefix (a checkpoint
    of the bare model loaded into one with a head, or the reverse)."""
    available = set(found)
    out = {}
    for key in wanted:
        candidates = [key]
        if prefix:
            candidates += [key.removeprefix(prefix + "."), f"{prefix}.{key}"]
        for c in candidates:
            if c in available:
                out[key] = c
                break
    return out
