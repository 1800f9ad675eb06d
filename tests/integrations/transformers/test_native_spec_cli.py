"""``attnzoo native-spec CONFIG`` on the configs transformers writes and on hostile ones: each case ends, within
seconds, in a correct answer (exit 0) or in one line on stderr that names the file and the field (exit 2), never a
traceback, a refusal of what transformers itself wrote, or an echo of a whole oversized value."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("transformers")

from attnzoo.cli import main  # noqa: E402

#: Seconds one case may take once the imports are warm (each takes well under one here; a loaded machine is slower).
SECONDS = 20
SOFTCAP_SPEC = "name: capped\nattention: {causal: true}\ntransforms:\n  - {kind: softcap, cap: 30.0}\n"
SCALE_SPEC = "name: scaled\nattention: {causal: true, scale: 0.5}\ntransforms: []\n"
_TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128)


def _saved(family: str, **overrides):
    """A writer of ``config.json``: transformers' own ``save_pretrained`` of a tiny ``family`` configuration, with
    an infinite float (which transformers writes as ``{"__float__": "Infinity"}``)."""

    def write(folder):
        from transformers import AutoConfig

        AutoConfig.for_model(family, **{**_TINY, **overrides}).save_pretrained(folder)
        assert '"__float__": "Infinity"' in (folder / "config.json").read_text()
        return folder

    return write


def _text(text: str, name: str = "config.json"):
    def write(folder):
        (folder / name).write_text(text)
        return folder / name

    return write


def _json(data: dict):
    return _text(json.dumps(data))


def _gemma2():
    from attnzoo.integrations.transformers import matrix

    def write(folder):
        matrix.config("gemma2").save_pretrained(folder)
        (folder / "capped.yaml").write_text(SOFTCAP_SPEC)
        (folder / "scaled.yaml").write_text(SCALE_SPEC)
        return folder

    return write


#: (id, writer of the input (returns the path given to native-spec), extra arguments, exit code, fragments the answer
#: contains (stdout on exit 0, the one stderr line otherwise), fragments it must not contain)
CASES = [
    # 1. transformers writes inf as {"__float__": "Infinity"} (falcon_h1's time_step_limit): loaded as transformers
    #    loads it; a hybrid with recurrent layers is then refused for that, not for its JSON
    ("falcon_h1-inf", _saved("falcon_h1"), [], 2, ["config.json", "FalconH1"],
     ["not readable JSON", "rejects it", "__float__"]),
    ("bamba-inf", _saved("bamba"), [], 2, ["config.json", "Bamba"], ["not readable JSON", "rejects it", "__float__"]),
    ("llama-with-an-inf-field", _saved("llama", extra_limit=float("inf")), [], 0,
     ["llama, 2 attention layers, native specs", "layer   1"], []),
    # 2. a conflict names the CLI's option, not apply()'s argument
    ("softcap-conflict", _gemma2(), ["--spec", "{dir}/capped.yaml"], 2,
     ["config.json", "softcap", "--prefer model", "--prefer spec"], ["prefer=", "apply()"]),
    ("scale-conflict", _gemma2(), ["--spec", "{dir}/scaled.yaml"], 2,
     ["config.json", "attention.scale", "--prefer model", "--prefer spec"], ["prefer=", "apply()"]),
    ("softcap-prefer-model", _gemma2(), ["--spec", "{dir}/capped.yaml", "--prefer", "model"], 0,
     ["with spec 'capped'", "softcap(cap=50.0)"], ["cap=30"]),
    ("softcap-prefer-spec", _gemma2(), ["--spec", "{dir}/capped.yaml", "--prefer", "spec"], 0,
     ["with spec 'capped'", "softcap(cap=30.0)"], ["cap=50"]),
    # 3. sizes the config dictates: bounded, or never allocated (the probe stays on the meta device)
    ("100000-layers", _json({"model_type": "llama", "num_hidden_layers": 100000}), [], 2,
     ["config.json", "num_hidden_layers = 100000", "256"], []),
    ("100000-layers-in-a-sub-config", _json({"model_type": "gemma3", "text_config": {"num_hidden_layers": 100000}}),
     [], 2, ["config.json", "text_config.num_hidden_layers = 100000", "256"], []),
    ("8192-heads", _json({"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 8192,
                          "num_hidden_layers": 1}), [], 2, ["config.json", "num_attention_heads = 8192", "4,096"], []),
    ("head_dim-100000", _json({"model_type": "llama", "head_dim": 100000, "num_hidden_layers": 1}), [], 2,
     ["config.json", "head_dim = 100000", "4,096"], []),
    ("vocab-10^12", _json({"model_type": "llama", "vocab_size": 10**12, "num_hidden_layers": 1}), [], 2,
     ["config.json", "vocab_size = 1000000000000"], []),
    ("experts-100000", _json({"model_type": "mixtral", "num_local_experts": 100000, "num_hidden_layers": 1}), [], 2,
     ["config.json", "num_local_experts = 100000", "1,024"], []),
    ("mixtral-hidden-65536", _json({"model_type": "mixtral", "hidden_size": 65536, "num_hidden_layers": 2}), [], 0,
     ["mixtral, 2 attention layers", "H32/8 D2048"], []),
    ("cpu-only-model-over-1-GiB", _json({"model_type": "jetmoe", "hidden_size": 32768, "num_hidden_layers": 8}), [],
     2, ["config.json", "GiB, over the 1 GiB", "hidden_size 32768"], []),
    ("positions-10^12", _json({"model_type": "llama", "max_position_embeddings": 10**12, "num_hidden_layers": 1}), [],
     0, ["llama, 1 attention layers"], []),
    # ... and text the parser would recurse into, or echo whole
    ("100000-deep-arrays", _text("[" * 100_000 + "]" * 100_000), [], 2, ["config.json", "nested more than 32 deep"],
     []),
    ("100000-deep-objects", _text('{"model_type": "llama", "x": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001), [], 2,
     ["config.json", "nested more than 32 deep"], []),
    ("brackets-inside-strings", _json({"model_type": "llama", "num_hidden_layers": 1, "note": "[{" * 1000}), [], 0,
     ["llama, 1 attention layers"], []),
    ("3000000-character-model_type", _json({"model_type": "x" * 3_000_000}), [], 2,
     ["config.json", "model_type 'xxx", "…' is not one transformers knows"], []),
    ("3000000-character-value", _json({"model_type": "llama", "num_hidden_layers": "x" * 3_000_000}), [], 2,
     ["config.json", "transformers rejects it", "num_hidden_layers", "…"], []),
    ("5000-digit-integer", _text('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}"), [], 2,
     ["config.json", "not readable JSON", "digits"], []),
    ("truncated-json", _text('{"model_type": "llama"'), [], 2, ["config.json", "not readable JSON"], []),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_native_spec_answers_or_refuses_in_one_line_within_seconds(case, tmp_path, capsys):
    _, write, extra, code, wanted, unwanted = case
    target = write(tmp_path)
    argv = ["native-spec", str(target), *(a.replace("{dir}", str(tmp_path)) for a in extra)]
    import attnzoo.integrations.transformers.core  # noqa: F401 - imports outside the timed part

    start = time.perf_counter()
    got = main(argv)
    seconds = time.perf_counter() - start
    out, err = capsys.readouterr()
    if code == 0:
        assert got == 0 and not err.strip(), err
        answer = out
    else:
        assert got == code and not out, (got, out)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        answer = err
        assert len(answer) < 600, f"{len(answer)} characters"
        assert max(len(word) for word in answer.replace(str(target), "FILE").split()) <= 90, answer  # 80 and quotes
    for fragment in wanted:
        assert fragment in answer, answer[:600]
    for fragment in unwanted:
        assert fragment not in answer, answer[:600]
    assert seconds < SECONDS, f"{seconds:.1f} s"
