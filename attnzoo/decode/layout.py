"""The one definition of the fused decoding steps' arguments (issue 41): each op's name, and each argument's name and
type, in order. The torch schema registered for the op and the C++ parameter list of its kernel are both generated
from :data:`OPS` (:func:`header`, written beside the C++ source at build time), and the Python side fills every
call by name from the schema the loaded op reports (:func:`order`), so there is no block of slots to mirror by hand:
reordering two arguments here reorders them everywhere, and a C++ body that reads an argument that is not here does
not compile.

Types are the schema's: ``Tensor`` (read), ``Tensor(x!)`` (written in place: the op's mutated arguments, each in its
own alias set), ``Tensor(x!)?`` (written, may be None), ``int``, ``float`` (a double), ``bool``.
"""

from __future__ import annotations

from collections.abc import Mapping

#: the arguments every evicting step takes first: the new token's query (B, H, 1, D), key and value (B, H_kv, 1, D)
#: (any batch and head strides, rows contiguous); the position it takes (``next``, every row) or, when ``nexts`` is
#: given, nexts[b] in row b, each moved on by one; the cache's buffers (B, H_kv, slots[, D]) and the tokens held
_STEP = [("q", "Tensor"), ("k", "Tensor"), ("v", "Tensor"), ("next", "int"), ("nexts", "Tensor(e!)?"),
         ("keys", "Tensor(a!)"), ("values", "Tensor(b!)"), ("positions", "Tensor(c!)")]

#: op name -> (arguments, returns). The options after ``scale`` are the evictor's (``Evictor.kernel_rule``, named by
#: :data:`RULE_OPTIONS`) and the spec's (the selector head).
OPS: dict[str, tuple[list[tuple[str, str]], str]] = {
    "selective_step": (_STEP + [
        ("scores", "Tensor(d!)"), ("held", "int"), ("scale", "float"),
        ("protect_first", "bool"),      # position 1 (BOS) is never the victim
        ("selector_kv_head", "int"),    # the selector head: its key/value head
        ("selector_in_group", "int"),   # and its index in that head's group of query heads
        ("selection_rule", "int"),      # S = rule(l) of the selector head's logits: SELECTION_RULES (0: refused)
        ("zero_first_score", "bool"),   # S = 0 at position 1 (protect_bos)
        ("zero_own_score", "bool"),     # S = 0 at the query's own key (no self_mask)
    ], "Tensor"),
    "sink_window_step": (_STEP + [
        ("held", "int"), ("scale", "float"),
        ("sinks", "int"),               # the first positions that never leave
    ], "Tensor"),
    "scoring_step": (_STEP + [
        ("scores", "Tensor(d!)"), ("held", "int"), ("scale", "float"),
        ("tova", "bool"),               # TOVA's update (the mean over heads replaces the score), else H2O's (adds)
        ("recent", "int"),              # H2O: positions > next - recent never leave (TOVA: 0)
    ], "Tensor"),
    "append_step": ([
        ("k", "Tensor"), ("v", "Tensor"), ("next", "int"), ("nexts", "Tensor(e!)?"),
        ("slot", "int"),                # the slot the new token goes into (< the buffers' slots)
        ("keys", "Tensor(a!)"), ("values", "Tensor(b!)"), ("positions", "Tensor(c!)"),
    ], "()"),
}

#: the C step of each ``KernelRule.kernel`` and the names of the rule's options, in the order the evictor gives them
#: (a mapping by name is taken as it is)
KERNELS = {"selective": "selective_step", "sink_window": "sink_window_step", "scoring": "scoring_step",
           "append": "append_step"}
RULE_OPTIONS = {"selective": ("protect_first",), "sink_window": ("sinks",), "scoring": ("tova", "recent"),
                "append": ()}

#: the selection rules the selective step computes (``PointwiseSelection.rule``, attnzoo/transforms/base.py) -> its
#: ``selection_rule`` option; 0 (an option left out) is no rule and the op refuses it
SELECTION_RULES = {"relu": 1}

#: the arguments a step passes at every call, first (the rest are fixed when the buffers are laid out)
PER_CALL = {"selective_step": ("q", "k", "v", "next", "nexts"), "sink_window_step": ("q", "k", "v", "next", "nexts"),
            "scoring_step": ("q", "k", "v", "next", "nexts"), "append_step": ("k", "v", "next", "nexts", "slot")}

_CPP = {"Tensor": "const at::Tensor&", "int": "int64_t", "float": "double", "bool": "bool"}


def schema(op: str) -> str:
    """The op's torch schema, without its namespace: ``name(Tensor q, ...) -> Tensor``."""
    args, returns = OPS[op]
    return f"{op}({', '.join(f'{kind} {name}' for name, kind in args)}) -> {returns}"


def _cpp_type(kind: str) -> str:
    base = kind.split("(")[0].rstrip("?")
    cpp = _CPP[base]
    return "const std::optional<at::Tensor>&" if kind.endswith("?") else cpp


def header(namespace: str) -> str:
    """The C++ header the kernel source includes (``fused_decode_ops.h``): per op, its schema
    (``ATTNZOO_<OP>_SCHEMA``) and its kernel's parameter list (``ATTNZOO_<OP>_PARAMS``), and the namespace the ops are
    registered in (``ATTNZOO_OP_NAMESPACE``)."""
    lines = ["/* Generated from attnzoo/decode/layout.py at build time: do not edit. */", "#pragma once",
             f"#define ATTNZOO_OP_NAMESPACE {namespace}"]
    for op, (args, returns) in OPS.items():
        upper = op.upper()
        lines.append(f'#define ATTNZOO_{upper}_SCHEMA "{schema(op)}"')
        params = ", ".join(f"{_cpp_type(kind)} {name}" for name, kind in args)
        lines.append(f"#define ATTNZOO_{upper}_RETURNS {'void' if returns == '()' else 'at::Tensor'}")
        lines.append(f"#define ATTNZOO_{upper}_PARAMS {params}")
    return "\n".join(lines) + "\n"


def named_options(kernel: str, options, **more) -> dict:
    """The rule's options by name: ``options`` as the evictor gives them (a tuple in :data:`RULE_OPTIONS` order, or
    a mapping by name), with ``more`` (the spec's: the selector head). Every option the op takes must be given
    (a missing or an unknown one is a ValueError)."""
    names = RULE_OPTIONS[kernel]
    if isinstance(options, Mapping):
        given = dict(options)
    else:
        options = tuple(options)
        if len(options) > len(names):
            raise ValueError(f"the {kernel} step takes {len(names)} rule options ({', '.join(names)}), got "
                             f"{len(options)}")
        given = dict(zip(names, options, strict=False))
    given.update(more)
    args = OPS[KERNELS[kernel]][0]
    wanted = [name for name, _ in args[args.index(("positions", "Tensor(c!)")) + 1:]
              if name not in ("scores", "held", "scale")]
    unknown = set(given) - set(wanted)
    if unknown:
        raise ValueError(f"the {kernel} step has no option {', '.join(sorted(unknown))}")
    for name in wanted:  # options a rule leaves out are off (0)
        given.setdefault(name, 0)
    kinds = dict(args)
    return {name: (bool(value) if kinds[name] == "bool" else int(value)) for name, value in given.items()}


def order(op: str, op_schema, values: Mapping[str, object]) -> tuple:
    """The values of ``op_schema``'s arguments (the loaded op's ``_schema``) in its order, by name, less those passed
    at every call (:data:`PER_CALL`, which lead): a schema whose names differ from these is an error here, once,
    not a silent swap."""
    skip = PER_CALL[op]
    names = [a.name for a in op_schema.arguments]
    if tuple(names[:len(skip)]) != skip:
        raise RuntimeError(f"the fused op {op_schema.name} takes {names[:len(skip)]} first, not {list(skip)}")
    rest = names[len(skip):]
    if set(rest) != set(values):
        raise RuntimeError(f"the fused op {op_schema.name} takes {rest}, the step gives {sorted(values)}")
    return tuple(values[name] for name in rest)
