"""The family sweep: every causal LM the installed transformers ships, built tiny and checked against its own eager
attention (docs/transformers.md; the generated table docs/reference/families.md;
``tests/integrations/transformers/test_hf_sweep.py``), each family built tiny by :mod:`.sweep_models`.

:func:`run` (and :func:`classify`) puts one family through the integration's contract with ``vanilla``:

- ``"exact"``: ``apply`` accepts it and it computes the model's own eager attention: the logits of a prompt that
  crosses every window and chunk several times (float32, within 1e-5 relative and absolute), each row of a
  left-padded batch as that row alone (``position_ids`` from the mask, the same numbering for the row alone),
  greedy ``generate`` as eager's, and the padded batch generating each row as eager does alone. Where transformers'
  own cached generation differs from its generation without a cache (its cache computes something else than its
  forward), the tokens without a cache are the reference, and the detail says so, as it gives what ``apply``
  warned about the family (:class:`~.base.FamilyWarning`);
- ``"refused"``: ``apply`` raises :class:`IntegrationError` with a one-line message (the detail);
- ``"wrong"``: ``apply`` accepts it and the model then computes something else (the detail says what differs);
- ``"failing"``: anything else: an exception after ``apply`` (the detail names it and where it came from), from
  ``apply`` other than an ``IntegrationError``, or a refusal of several lines;
- ``"cannot build"``: transformers cannot build the family tiny (or even its default configuration), or its own
  eager model fails on CPU (the detail says why): not a verdict on the integration.

``python -m attnzoo.integrations.transformers.sweep [model_type ...] [--jobs N]`` prints the table.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from .base import FamilyWarning
from .sweep_models import BOS, PAD, VOCAB, CannotBuild, build, one_line, quiet

#: The unpadded prompt (several windows and chunks), the rows of the padded batch, the tokens generated.
PROMPT = 20
ROWS = (20, 13)
NEW = 12
TOLERANCE = 1e-5
VERDICTS = ("exact", "refused", "wrong", "failing", "cannot build")


def model_types() -> list[str]:
    """Every ``model_type`` of the installed transformers' causal-LM mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# -- the checks ----------------------------------------------------------------------------------------------------
@dataclass
class Result:
    """One family's verdict (:data:`VERDICTS`) and what the table shows of it."""

    model_type: str
    verdict: str
    detail: str = ""
    module: str = ""          #: the attention module's class (when the probe read it)
    geometry: str = ""        #: H / H_kv / D of the first layer
    layers: list = field(default_factory=list)  #: each layer's native spec, as the table shows it
    named: bool = False       #: a refusal names the model or one of its modules (a layer) by class
    seconds: float = 0.0


def prompt(length: int, generator) -> Any:
    import torch

    ids = torch.randint(2, VOCAB, (length,), generator=generator)
    ids[0] = BOS
    return ids


def left_pad(rows):
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
    return ids, (ids != PAD).long()


def _takes(model, name: str) -> bool:
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _logits(model, ids, mask=None, positions=None):
    kwargs: dict[str, Any] = {"use_cache": False}
    if mask is not None:
        kwargs["attention_mask"] = mask
    if positions is not None:
        kwargs["position_ids"] = positions
    out = model(ids, **kwargs)
    return (out.logits if hasattr(out, "logits") else out[0]).float()


def _generate(model, ids, mask=None, **kwargs):
    import torch

    kwargs = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=None, **kwargs)
    mask = torch.ones_like(ids) if mask is None else mask
    return model.generate(ids, attention_mask=mask, **kwargs)


def _gap(a, b) -> float:
    return float((a - b).abs().max())


def _close(got, want) -> bool:
    import torch

    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=TOLERANCE, atol=TOLERANCE))


def _first_diff(got, want) -> int:
    diff = (got != want).nonzero()
    return int(diff[0, -1]) if len(diff) else -1


def _where(exc: BaseException) -> str:
    """The innermost frame of a traceback outside torch's module machinery: where the exception came from."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "torch/nn/modules/module.py" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    path = f.filename
    for marker in ("site-packages/", "attnzoo/"):
        if marker in path:
            path = (marker if marker == "attnzoo/" else "") + path.split(marker, 1)[1]
            break
    return f"{path}:{f.lineno} ({f.name})"


def describe_layers(layers) -> list[str]:
    """Each :class:`NativeLayer`'s native spec in a few words (``"0: sliding_window 4, softcap 50.0"``)."""
    shown = []
    for layer in layers:
        data = layer.spec_data()
        scale = data["attention"]["scale"]
        parts = [f"scale {scale:.4g}"] if scale is not None else []
        parts += [t["kind"] + "".join(f" {v}" for k, v in t.items() if k not in ("kind", "learnable", "value"))
                  for t in data["transforms"]]
        parts += [f"sink = `{layer.call.sinks}`"] if layer.call.sinks else []
        shown.append(f"{layer.layer}: " + (", ".join(parts) or "plain causal"))
    return shown


def run(model_type: str, seed: int = 0) -> Result:
    """Build ``model_type`` tiny and run it through the contract (the module docstring); never raises."""
    started = time.perf_counter()
    with quiet():
        result = _run(model_type, seed)
    result.seconds = time.perf_counter() - started
    return result


def _run(model_type: str, seed: int) -> Result:
    import torch

    from . import IntegrationError, apply
    from .base import applied_modules
    from .native import NativeLayer

    try:
        model = build(model_type, seed)
    except CannotBuild as exc:
        return Result(model_type, "cannot build", str(exc))
    generator = torch.Generator().manual_seed(seed + 1)
    whole = prompt(PROMPT, generator)[None]
    rows = [whole[0], *(prompt(n, generator) for n in ROWS[1:])]  # the first row is the unpadded prompt
    padded, mask = left_pad(rows)
    # position_ids as generate() makes them from the mask (the models with absolute positions need them), and the
    # same numbering for each row alone (some number from padding_idx + 1 when given none: RoBERTa)
    positions = (mask.cumsum(-1) - 1).clamp(min=0) if _takes(model, "position_ids") else None
    alone = [None if positions is None else positions[i, padded.shape[1] - n:][None] for i, n in enumerate(ROWS)]

    def eager_fails(stage: str, exc: BaseException) -> Result:
        return Result(model_type, "cannot build", f"its own eager model fails in {stage} on CPU: {one_line(exc)} "
                      f"[{_where(exc)}]")

    try:  # the model's own eager attention: what attnzoo must compute
        with torch.no_grad():
            want = _logits(model, whole)
    except Exception as exc:  # noqa: BLE001
        return eager_fails("a forward pass", exc)
    if not torch.isfinite(want).all():
        return Result(model_type, "cannot build", "its own eager model gives non-finite logits")
    reference = copy.deepcopy(model)  # stays eager: the rest of what attnzoo must compute, once apply() accepts it
    try:
        with warnings.catch_warnings(record=True) as warned:  # apply()'s word on the family, in the detail
            warnings.simplefilter("always", FamilyWarning)
            apply(model, "vanilla")
    except IntegrationError as exc:
        message = str(exc)
        if "\n" in message.strip():
            return Result(model_type, "failing", f"refused with a message of several lines: {one_line(exc)}")
        named = any(name in message for name in {type(m).__name__ for m in model.modules()})
        return Result(model_type, "refused", message, named=named)
    except Exception as exc:  # noqa: BLE001
        return Result(model_type, "failing", f"apply() raised {one_line(exc)} [{_where(exc)}]")
    native = [NativeLayer(module.attnzoo.hf_call, model_type) for module in applied_modules(model)]
    call = native[0].call
    result = Result(model_type, "exact", module=call.module, layers=describe_layers(native),
                    geometry=f"{call.num_heads} / {call.num_kv_heads} / {call.head_dim}")

    stage = "a forward pass"
    try:
        with torch.no_grad():
            want_rows = [_logits(reference, r[None], positions=p)[0] for r, p in zip(rows, alone, strict=True)]
        stage = "greedy generate"
        want_alone = [_generate(reference, r[None])[0] for r in rows]
    except Exception as exc:  # noqa: BLE001
        return eager_fails(stage, exc)

    stage = "the unpadded forward"
    problems: list[str] = []
    notes: list[str] = [f"apply() warns: {w.message}" for w in warned if issubclass(w.category, FamilyWarning)]

    def check(got_tokens, want_tokens, ids, what: str) -> None:
        """Eager's greedy tokens, with its cache; where those are not eager's own without a cache (transformers'
        cache computes something else than its forward), the forward's, noted."""
        if torch.equal(got_tokens, want_tokens):
            return
        plain = _generate(reference, ids, use_cache=False)[0]
        if torch.equal(got_tokens, plain) and not torch.equal(want_tokens, plain):
            notes.append(f"{what} matches eager's without a cache; eager's own with its cache differs from it "
                         f"from token {_first_diff(want_tokens, plain) - ids.shape[1]}")
            return
        problems.append(f"{what} differs from eager's from token {_first_diff(got_tokens, want_tokens) - ids.shape[1]}"
                        f" of {NEW}")

    try:
        with torch.no_grad():
            got = _logits(model, whole)
            if not _close(got, want):
                problems.append(f"logits of a {PROMPT}-token prompt differ from eager's (max |diff| "
                                f"{_gap(got, want):.3g})")
            stage = "the left-padded forward"
            got_batch = _logits(model, padded, mask, positions)
        for i, r in enumerate(rows):
            got_row = got_batch[i, padded.shape[1] - len(r):]
            if not _close(got_row, want_rows[i]):
                problems.append(f"row {i} of a left-padded batch differs from the row alone (max |diff| "
                                f"{_gap(got_row, want_rows[i]):.3g})")
        stage = "greedy generate"
        check(_generate(model, whole)[0], want_alone[0], whole, "greedy generate")
        stage = "greedy generate of the left-padded batch"
        batch = _generate(model, padded, mask)
        for i, r in enumerate(rows):
            check(batch[i, padded.shape[1] - len(r):], want_alone[i], r[None], f"row {i} of the padded batch")
    except Exception as exc:  # noqa: BLE001
        result.verdict = "failing"
        result.detail = "; ".join([*problems, f"{stage} raised {one_line(exc)} [{_where(exc)}]"])
        return result
    result.verdict = "wrong" if problems else "exact"
    result.detail = "; ".join(problems + notes)
    return result


def classify(model_type: str, seed: int = 0) -> tuple[str, str]:
    """``(verdict, detail)`` of ``model_type`` (:data:`VERDICTS`; see the module docstring)."""
    result = run(model_type, seed)
    return result.verdict, result.detail


def sweep(model_types_: list[str] | None = None, jobs: int = 1) -> list[Result]:
    """:func:`run` for every family (default :func:`model_types`), in ``jobs`` processes."""
    names = model_types() if model_types_ is None else list(model_types_)
    if jobs <= 1:
        return [run(name) for name in names]
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with contextlib.closing(context.Pool(jobs, initializer=_one_thread)) as pool:
        return list(pool.imap(run, names, chunksize=1))


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # tiny models: a thread per process beats processes sharing the cores


def main(argv: list[str] | None = None) -> int:
    """``python -m attnzoo.integrations.transformers.sweep [model_type ...] [--jobs N]``: the table."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    _one_thread()
    for result in sweep(args.model_types or None, args.jobs):
        print(f"{result.model_type}\t{result.verdict}\t{result.seconds:.1f}s\t{result.detail}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
