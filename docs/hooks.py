"""mkdocs hooks: the reference pages, generated from the code at every build (none is edited by hand).

- ``reference/spec-schema.md``: the JSON schema of a spec file, from the pydantic model the registry builds;
- ``reference/catalogue.md``: every registered transform and evictor (plugins' too), with its options and
  parameters;
- ``reference/support.md``: which backend runs each registered spec in each mode, or why not (``explain``);
- ``reference/api.md``: the API reference of every name in ``attnzoo.__all__`` (mkdocstrings);
- ``reference/families.md``: the transformers families: the curated matrix and each family's native specs, read
  from tiny models of ``attnzoo.integrations.transformers.matrix``, and the sweep of every causal LM the installed
  transformers ships (``attnzoo.integrations.transformers.sweep``: each family's verdict, its native specs or
  the reason); both are the configurations the test suite checks.

A new transform therefore appears in the catalogue, the schema and the support matrix without editing any page.
"""

from __future__ import annotations

import json

from mkdocs.structure.files import File

GENERATED = ("reference/spec-schema.md", "reference/catalogue.md", "reference/support.md", "reference/api.md",
             "reference/families.md")


def on_files(files, config):
    for path, make in zip(GENERATED, (spec_schema, catalogue, support, api, families), strict=True):
        files.append(File.generated(config, path, content=make()))
    return files


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def spec_schema() -> str:
    import attnzoo

    model = attnzoo.get_registry().spec_model()
    schema = model.model_json_schema()
    rows = [f"| `{name}` | {_cell(field.description or '')} | {'yes' if field.is_required() else 'no'} |"
            for name, field in model.model_fields.items()]
    return "\n".join([
        "# Spec schema", "",
        "Generated from the pydantic model that validates spec files (`Registry.spec_model()`), with every "
        "registered transform and evictor. `transforms` is a list discriminated by `kind`, `cache` by `evictor`.",
        "", "| key | meaning | required |", "|---|---|---|", *rows, "",
        "The JSON schema (editors can use it to check spec files as you type):", "",
        "```json", json.dumps(schema, indent=1, sort_keys=True), "```", ""])


def _options(options_model) -> str:
    parts = []
    for name, field in options_model.model_fields.items():
        if name in ("kind", "evictor"):
            continue
        default = "required" if field.is_required() else f"default `{field.default!r}`"
        annotation = getattr(field.annotation, "__name__", str(field.annotation)).replace("typing.", "")
        text = f"`{name}` ({_cell(annotation)}, {default})"
        if field.description:
            text += f": {_cell(field.description)}"
        parts.append(text)
    return "; ".join(parts) or "none"


def _parameters(cls) -> str:
    try:
        instance = cls(cls.options_model()(kind=cls.kind))
        params = instance.parameters()
    except Exception:  # noqa: BLE001 - options without defaults: the parameters depend on them
        return "depend on the options"
    return ", ".join(f"`{p.name}` {tuple(p.shape)}" for p in params) or "none"


def catalogue() -> str:
    import attnzoo

    reg = attnzoo.get_registry()
    lines = ["# Transforms and evictors", "",
             "Every transform and evictor registered when the docs were built (the built-ins and installed "
             "plugins), generated from the registry: `attnzoo list` shows the same.", ""]
    by_slot: dict[str, list] = {}
    for kind, cls in sorted(reg.transforms.items()):
        by_slot.setdefault(cls.slot.value, []).append((kind, cls))
    for slot, items in by_slot.items():
        lines += [f"## Slot `{slot}`", "", "| kind | what it does | options | parameters | plugin |",
                  "|---|---|---|---|---|"]
        for kind, cls in items:
            lines.append(f"| `{kind}` | {_cell(cls.summary)} | {_options(cls.options_model())} | "
                         f"{_parameters(cls)} | {reg.origin[('transforms', kind)]} |")
        lines.append("")
    lines += ["## Evictors", "", "| evictor | rule | options | plugin |", "|---|---|---|---|"]
    for kind, cls in sorted(reg.evictors.items()):
        lines.append(f"| `{kind}` | {_cell(cls.summary)} | {_options(cls.options_model())} | "
                     f"{reg.origin[('evictors', kind)]} |")
    return "\n".join(lines) + "\n"


def support() -> str:
    import torch

    import attnzoo
    from attnzoo.backends.base import Mode
    from attnzoo.dispatch import verdicts
    from attnzoo.plan import Plan

    reg = attnzoo.get_registry()
    cases = [("cpu", torch.float32, Mode.FORWARD), ("cpu", torch.float32, Mode.BACKWARD),
             ("cpu", torch.float32, Mode.DECODE), ("cuda", torch.bfloat16, Mode.FORWARD),
             ("cuda", torch.bfloat16, Mode.BACKWARD)]
    lines = ["# Backend support", "",
             "Which backends can run each registered spec, case by case, generated from the backends' own verdicts: "
             "`attnzoo explain SPEC --device D --dtype T --mode M` prints the same with every reason in full. "
             "`auto` picks the first backend that can, by priority (the column order). The GPU cases say what a "
             "CUDA machine would run; they are computed without one. On CPU the triton backend runs only in "
             "Triton's interpreter (`TRITON_INTERPRET=1`, a checking mode).", ""]
    notes: dict[str, int] = {}
    for device, dtype, mode in cases:
        backends = None
        rows = []
        for name in sorted(reg.specs):
            plan = Plan.from_spec(reg.specs[name], reg)
            reasons = verdicts(plan, reg, torch.device(device), dtype, mode)
            backends = backends or list(reasons)
            cells = []
            for backend in backends:
                why = reasons[backend]
                if not why:
                    cells.append("yes")
                    continue
                cells.append(f"no [{notes.setdefault(f'{backend}: {why[0]}', len(notes) + 1)}]")
            rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
        lines += [f"## {device}, {str(dtype).removeprefix('torch.')}, {mode.value}", "",
                  "| spec | " + " | ".join(f"`{b}`" for b in backends) + " |", "|---" * (len(backends) + 1) + "|",
                  *rows, ""]
    lines += ["## Reasons", ""] + [f"{n}. {_cell(why)}" for why, n in notes.items()]
    return "\n".join(lines) + "\n"


def api() -> str:
    import attnzoo

    names = [n for n in attnzoo.__all__ if not n.startswith("_")]
    lines = ["# Python API", "", "Every public name (`attnzoo.__all__`), from its docstring.", ""]
    lines += [f"::: attnzoo.{name}\n" for name in names]
    return "\n".join(lines)


def families() -> str:
    """The families: the curated matrix (each family's tiny configuration, read by the integration's probe into
    native specs) and the sweep of every causal LM the installed transformers ships (its verdict, and each exact
    family's native specs)."""
    import collections
    import logging
    import os

    import torch
    import transformers

    from attnzoo.integrations import transformers as zt
    from attnzoo.integrations.transformers import matrix, sweep, sweep_models

    logging.getLogger("transformers").setLevel(logging.ERROR)
    # ATTNZOO_DOCS_SWEEP: unset, every family of the sweep (a minute or two); "a,b,c", only those (a quick build)
    chosen = os.environ.get("ATTNZOO_DOCS_SWEEP", "").strip()
    names = [n for n in chosen.split(",") if n.strip()] if chosen else sweep.model_types()
    results = sweep.sweep(names, jobs=max(1, min(4, os.cpu_count() or 1, len(names))))
    counts = collections.Counter(r.verdict for r in results)
    tally = ", ".join(f"**{counts[v]} {v}**" for v in sweep.VERDICTS if counts[v] or v in ("exact", "refused"))
    every = len(sweep.model_types())
    partial = "" if len(results) == every else f" (this build swept only {len(results)} of them)"
    lines = ["# transformers families", "",
             f"The {every} causal language models transformers {transformers.__version__} ships (its causal-LM "
             f"mapping), built tiny and checked with `vanilla`{partial}: {tally}. Exact: the model's own "
             "eager attention (logits within 1e-5 in float32 over a prompt that crosses every window and chunk, a "
             "left-padded batch row by row, greedy generation alone and padded). Refused: `apply()` says why in one "
             "line. Cannot build: transformers cannot build the family tiny, or its own eager model does not run on "
             "CPU (not a verdict on attnzoo).", "",
             "## The curated matrix", "",
             "Generated from the family matrix (`attnzoo.integrations.transformers.matrix`): a tiny random-init "
             "configuration of each family the installed transformers ships, read by the integration's probe "
             "(what each layer passes to transformers' attention interface). "
             "`tests/integrations/transformers/test_hf_families.py` checks "
             "every row: `vanilla` equals the model's own eager attention (logits within 1e-5 in float32, greedy "
             "tokens equal) through a left-padded batch, generation to 4x the window, beams and a save/load round "
             f"trip. The matrix's windows are {matrix.WINDOW} tokens; a real checkpoint's are its config's "
             "(`attnzoo native-spec config.json` shows them).", "",
             "| family | what it exercises | attention module | H / H_kv / D | native spec of each layer |",
             "|---|---|---|---|---|"]
    for family in matrix.available():
        torch.manual_seed(0)
        layers = zt.native_layers(matrix.tiny_model(family))
        call = layers[0].call
        lines.append(f"| `{family}` | {_cell(matrix.FAMILIES[family][0])} | `{call.module}` | "
                     f"{call.num_heads} / {call.num_kv_heads} / {call.head_dim} | "
                     f"{'; '.join(sweep.describe_layers(layers))} |")
    lines += ["", "## Every causal LM: the sweep", "",
              "Generated by `attnzoo.integrations.transformers.sweep` "
              "(`tests/integrations/transformers/test_hf_sweep.py` checks every row): "
              "each `model_type` of transformers' causal-LM mapping built from `AutoConfig.for_model` with width "
              f"64, 4 query heads over 2 key/value heads of 16, windows and chunks of {sweep_models.WINDOW} tokens and "
              "every kind of layer the family has, its weights drawn again at a scale where attention patterns "
              f"matter; a prompt of {sweep.PROMPT} tokens, a left-padded batch of {' and '.join(map(str, sweep.ROWS))}"
              f" tokens, {sweep.NEW} tokens generated.", "",
              "| family | verdict | attention module | H / H_kv / D | native spec of each layer, or why |",
              "|---|---|---|---|---|"]
    for r in results:
        why = _cell("; ".join(r.layers)) if r.verdict == "exact" else ""
        if r.detail:  # a message, as it was given (a code span: it may hold <, _, * and single backticks)
            text = _cell(r.detail).replace("``", "` `")
            why += (" (" if why else "") + f"`` {text} ``" + (")" if why else "")
        module = f"`{r.module}`" if r.module else ""
        lines.append(f"| `{r.model_type}` | {r.verdict} | {module} | {r.geometry} | {why} |")
    return "\n".join(lines + [""])
