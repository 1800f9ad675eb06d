"""Every host reads a checkpoint's attnzoo record (``config.json``'s ``attnzoo`` key) the same way
(attnzoo/integrations/transformers/records.py, docs/transformers.md and docs/vllm.md): each hostile record below is
refused by ``zt.from_pretrained``, ``zt.load_transform_params``, the vLLM plugin's engine-start check
(``check_config``, as vLLM calls it, with a configuration as vLLM builds it) and ``attnzoo native-spec``, each with
one line that names the ``config.json`` and the field, quoting no more than a clipped excerpt of any value; a
malformed record is never read as "no record" (which would have vLLM serve the checkpoint with its own attention).

A tiny randomly initialised Llama with ``ssa`` applied, saved once; no downloads."""

from __future__ import annotations

import copy
import json
import re
import shutil
import types

import pytest

transformers = pytest.importorskip("transformers")

from attnzoo.cli import main  # noqa: E402
from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.vllm import ServeDeclined  # noqa: E402
from attnzoo.integrations.vllm.spec import record_of  # noqa: E402
from attnzoo.integrations.vllm.start import check_config  # noqa: E402
from attnzoo.spec import load_spec  # noqa: E402

HUGE = 200_000


def _edit(**changes):
    """A hostile record: the saved one with ``changes`` (a value of ``DROP`` removes the key)."""

    def make(record):
        out = copy.deepcopy(record)
        for key, value in changes.items():
            if value is DROP:
                out.pop(key)
            else:
                out[key] = value(out) if callable(value) else value
        return out

    return make


DROP = object()


def _edited_spec(record):
    spec = copy.deepcopy(record["spec"])
    spec["transforms"][0]["position_coefficient"] = "sigmoid"  # edited after saving, its hash left as it was
    return spec


def _renamed(old, new):
    def make(record):
        return {(new if key == old else key): value for key, value in record.items()}

    return make


#: (case, a hostile record made from the saved one, the field the refusal names, words it holds)
CASES = [
    ("edited spec, old hash", _edit(spec=_edited_spec), "attnzoo.hash", ["hashes to", "saved as"]),
    ("Spec for spec", _renamed("spec", "Spec"), "attnzoo.Spec", ["unknown key"]),
    ("list backend", _edit(backend=["blocked"]), "attnzoo.backend", ["got list"]),
    ("unknown backend", _edit(backend="warp-drive"), "attnzoo.backend", ["not a backend registered here"]),
    ("unknown key", _edit(extra=1), "attnzoo.extra", ["unknown key"]),
    ("hash missing", _edit(hash=DROP), "attnzoo.hash", ["missing"]),
    ("spec missing", _edit(spec=DROP), "attnzoo.spec", ["missing"]),
    ("int hash", _edit(hash=5), "attnzoo.hash", ["got int"]),
    ("short hash", _edit(hash="abc"), "attnzoo.hash", ["64 hex digits"]),
    ("int spec", _edit(spec=17), "attnzoo.spec", ["got int"]),
    ("spec is a path", _edit(spec="/etc/passwd"), "attnzoo.spec", ["is a path"]),
    ("spec unregistered", _edit(spec="no-such-spec"), "attnzoo.spec", ["no plugin registers"]),
    ("spec invalid", _edit(spec=lambda r: {**r["spec"], "transforms": [{"kind": "nope"}]}),
     "attnzoo.spec.transforms[0]", ["unknown kind"]),
    ("list name", _edit(name=["ssa"]), "attnzoo.name", ["got list"]),
    ("another name", _edit(name="selective"), "attnzoo.name", ["named 'ssa'"]),
    ("str budget", _edit(budget="big"), "attnzoo.budget", ["int >= 1"]),
    ("bool budget", _edit(budget=True), "attnzoo.budget", ["int >= 1"]),
    ("zero in budget list", _edit(budget=[4, 0]), "attnzoo.budget", ["int >= 1"]),
    ("empty budget list", _edit(budget=[]), "attnzoo.budget", ["a list of 0"]),
    ("int prefer", _edit(prefer=3), "attnzoo.prefer", ["one of error, model, spec"]),
    ("unknown prefer", _edit(prefer="maybe"), "attnzoo.prefer", ["'maybe'"]),
    ("record is a string", lambda r: "ssa", "attnzoo", ["JSON object", "got str"]),
    ("record is a list", lambda r: [r], "attnzoo", ["JSON object", "got list"]),
    ("record is null", lambda r: None, "attnzoo", ["JSON object", "got null"]),
    ("huge unknown key", lambda r: {**r, "k" * HUGE: 1}, "attnzoo.kkk", ["unknown key"]),
    ("huge hash", _edit(hash="f" * HUGE), "attnzoo.hash", ["64 hex digits"]),
    ("huge name", _edit(name="n" * HUGE), "attnzoo.name", []),
    ("huge backend", _edit(backend="b" * HUGE), "attnzoo.backend", []),
    ("huge prefer", _edit(prefer="p" * HUGE), "attnzoo.prefer", []),
    ("huge spec name", _edit(spec="s" * HUGE), "attnzoo.spec", []),
    ("huge embedded spec", _edit(spec=lambda r: {**r["spec"], "summary": "x" * HUGE, "name": "y" * HUGE}),
     "attnzoo.spec", []),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved after zt.apply(model, "ssa"): (folder, its record)."""
    folder = tmp_path_factory.mktemp("ssa-checkpoint")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    zt.apply(transformers.LlamaForCausalLM(config), "ssa").save_pretrained(folder)
    return folder, json.loads((folder / "config.json").read_text())["attnzoo"]


def _hostile(saved, tmp_path, make):
    folder, record = saved
    copy_ = tmp_path / "ckpt"
    shutil.copytree(folder, copy_)
    data = json.loads((copy_ / "config.json").read_text())
    data["attnzoo"] = make(record)
    (copy_ / "config.json").write_text(json.dumps(data))
    return copy_, data["attnzoo"]


def _vllm_config(folder, record):
    """What check_config gets from vLLM: the engine's configuration, its model the checkpoint folder."""
    hf = transformers.LlamaConfig(attnzoo=record)
    return types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf, model=str(folder)),
                                 parallel_config=types.SimpleNamespace(tensor_parallel_size=1,
                                                                       pipeline_parallel_size=1))


def _refusals(folder, record, capsys):
    """{host: its one-line refusal} of the checkpoint in ``folder``, whose record is ``record``."""
    out = {}
    with pytest.raises(zt.IntegrationError) as caught:
        zt.from_pretrained(folder)
    out["zt.from_pretrained"] = caught
    model = zt.apply(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)), "ssa")
    with pytest.raises(zt.IntegrationError) as caught:
        zt.load_transform_params(model, folder)
    out["zt.load_transform_params"] = caught
    with pytest.raises(ServeDeclined) as caught:  # not a ValueError: vLLM would wrap one in a validation report
        check_config(_vllm_config(folder, record), on_cpu=True)
    out["vllm check_config"] = caught
    with pytest.raises(zt.IntegrationError) as caught:
        record_of(_vllm_config(folder, record).model_config.hf_config, str(folder))
    out["vllm record_of"] = caught
    capsys.readouterr()
    assert main(["native-spec", str(folder)]) == 2
    cli = capsys.readouterr().err
    assert cli.startswith("attnzoo: ") and cli.count("\n") == 1
    out["attnzoo native-spec"] = cli.removeprefix("attnzoo: ").strip()
    return {host: value if isinstance(value, str) else str(value.value) for host, value in out.items()}


@pytest.mark.parametrize("make, field, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_host_refuses_a_hostile_record_naming_the_file_and_the_field(saved, tmp_path, capsys, make, field,
                                                                           words):
    folder, record = _hostile(saved, tmp_path, make)
    config = str(folder / "config.json")
    for host, message in _refusals(folder, record, capsys).items():
        assert "\n" not in message, (host, message)
        assert f"{config}: {field}" in message, (host, message)
        assert all(w in message for w in words), (host, message)
        assert len(message) < 700 and not re.search(r"(.)\1{99}", message), (host, message[:300])


def test_the_edited_spec_is_a_spec_mismatch_everywhere(saved, tmp_path):
    folder, record = _hostile(saved, tmp_path, _edit(spec=_edited_spec))
    with pytest.raises(zt.CheckpointSpecMismatchError):
        zt.from_pretrained(folder)
    with pytest.raises(zt.CheckpointSpecMismatchError):
        record_of(types.SimpleNamespace(attnzoo=record), str(folder))


def test_the_saved_record_is_read_the_same_by_every_host(saved, tmp_path, capsys):
    folder, record = saved
    want = {**record, "spec": record["spec"]}
    assert zt.check_record(record, "config.json") == want
    assert record_of(_vllm_config(folder, record).model_config.hf_config, str(folder)) == want
    check_config(_vllm_config(folder, record), on_cpu=True)
    assert zt.from_pretrained(folder).config.attnzoo["hash"] == record["hash"]
    assert main(["native-spec", str(folder)]) == 0
    assert "saved with attnzoo spec 'ssa'" in capsys.readouterr().out
    # a registered name instead of the embedded spec, optional keys at their defaults
    short = {"spec": "ssa", "hash": record["hash"]}
    assert zt.check_record(short, "config.json") == {**short, "name": "ssa", "budget": None, "backend": "auto",
                                                      "prefer": "error"}
    assert load_spec("ssa").hash == record["hash"]


def test_a_configuration_without_the_key_is_no_record_and_runs_vllms_own_attention(saved, tmp_path):
    folder, _ = saved
    hf = transformers.LlamaConfig()
    assert record_of(hf, str(folder)) is None
    check_config(types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=hf, model=str(folder)),
                                       parallel_config=None), on_cpu=False)
