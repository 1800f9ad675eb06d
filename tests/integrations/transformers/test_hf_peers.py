"""attnzoo beside kvpress in one process (issue 52): kvpress, imported after apply(), wraps every function in
transformers' ALL_ATTENTION_FUNCTIONS with one that passes ``dropout`` as the sixth positional argument, as
transformers' own functions take it; attnzoo's took ``scaling`` there (TypeError: got multiple values for argument
'scaling', then every apply() failed in the probe). A kvpress press compresses transformers' cache, which holds no
keys after apply(): it is refused in one line.

The unit tests run kvpress's wrapper as written (kvpress/attention_patch.py, 0.5.5) on a tiny Llama; the slow one
runs kvpress itself, in fresh interpreters (its import patches transformers for the whole process), where it is
importable: installed, or in a side folder named by ATTNZOO_KVPRESS_PATH (it pins an older transformers; see
docs/transformers.md, "kvpress in the same process")."""

import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers import interface  # noqa: E402

VOCAB, PAD, BOS = 64, 0, 1
GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None)


def tiny():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=PAD,
                                      bos_token_id=BOS, eos_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


def kvpress_patch(calls: list):
    """kvpress.attention_patch.patch_attention_functions, as kvpress 0.5.5 writes it (its key masking left out:
    it runs only for a module a press gave ``masked_key_indices``), counting calls."""
    def attention_patch(func):
        def wrapper(module, query, key, value, attention_mask, dropout, **kwargs):
            calls.append(func)
            if query.shape[2] == key.shape[2]:
                module.masked_key_indices = None
            if "cu_seq_lens_k" in kwargs:
                kwargs["cu_seq_lens_k"][-1] = key.shape[-2]
            return func(module, query, key, value, attention_mask, dropout, **kwargs)
        return wrapper

    for name, func in ALL_ATTENTION_FUNCTIONS.items():
        ALL_ATTENTION_FUNCTIONS[name] = attention_patch(func)


@pytest.fixture
def patched_later():
    """Installs the wrapper when called; transformers' registry as it was afterwards."""
    local = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    calls: list = []
    yield lambda: kvpress_patch(calls) or calls
    ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
    ALL_ATTENTION_FUNCTIONS._local_mapping.update(local)


def test_attention_forward_takes_transformers_own_arguments():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ours = list(inspect.signature(zt.attention_forward).parameters)
    theirs = list(inspect.signature(sdpa_attention_forward).parameters)
    assert ours[:7] == theirs[:7] == ["module", "query", "key", "value", "attention_mask", "dropout", "scaling"]
    assert list(inspect.signature(interface._probe_forward).parameters)[:7] == theirs[:7]


@pytest.mark.parametrize("spec", ["vanilla", "h2o"])
def test_a_wrapper_installed_after_apply_changes_nothing(spec, patched_later):
    model = zt.apply(tiny(), spec, budget=4 if spec == "h2o" else None)
    torch.manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 9))
    ids[:, 0] = BOS
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, **GREEDY)
    calls = patched_later()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
    assert torch.equal(model.generate(ids, **GREEDY), tokens)
    assert calls and all(f is zt.attention_forward for f in calls)
    # apply() again (its probe's function is wrapped too): the same model, the same tokens
    calls.clear()
    again = zt.apply(tiny(), spec, budget=4 if spec == "h2o" else None)
    assert torch.equal(again.generate(ids, **GREEDY), tokens)
    assert interface._probe_forward in calls and zt.attention_forward in calls


class FakePress:
    """A press as kvpress hooks it: a bound forward hook with kwargs on each attention module."""

    def forward_hook(self, module, args, kwargs, output):
        raise AssertionError("attnzoo must refuse before the press runs")


FakePress.__module__ = "kvpress.presses.fake_press"


def test_a_kvpress_press_on_an_applied_model_is_refused_in_one_line():
    model = zt.apply(tiny(), "h2o", budget=4)
    ids = torch.randint(2, VOCAB, (1, 9))
    mine = [layer.self_attn.register_forward_hook(lambda *a: None) for layer in model.model.layers]
    model.generate(ids, **GREEDY)  # a hook of the user's own is no press
    press = FakePress()
    hooks = [layer.self_attn.register_forward_hook(press.forward_hook, with_kwargs=True)
             for layer in model.model.layers]
    with pytest.raises(zt.IntegrationError) as info:
        model.generate(ids, **GREEDY)
    message = str(info.value)
    assert "\n" not in message and message.startswith("LlamaAttention (layer 0): a kvpress press (FakePress) is "
                                                      "hooked on this layer")
    assert "evicting spec" in message
    for hook in hooks + mine:
        hook.remove()
    model.generate(ids, **GREEDY)


KVPRESS_RUN = textwrap.dedent("""
    import os, sys
    sys.path.append(os.environ["ATTNZOO_KVPRESS_PATH"]) if os.environ.get("ATTNZOO_KVPRESS_PATH") else None
    import torch, transformers
    order = sys.argv[1]
    if order == "kvpress-first":
        import kvpress
    from attnzoo.integrations import transformers as zt

    def tiny():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                          bos_token_id=1, eos_token_id=None)
        return transformers.LlamaForCausalLM(config).eval()

    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    torch.manual_seed(1)
    ids = torch.randint(2, 64, (1, 9))
    model = zt.apply(tiny(), "h2o", budget=4)
    tokens = model.generate(ids, **greedy)
    if order == "attnzoo-first":
        import kvpress
    assert torch.equal(model.generate(ids, **greedy), tokens)
    assert torch.equal(zt.apply(tiny(), "h2o", budget=4).generate(ids, **greedy), tokens)
    assert torch.equal(tiny().generate(ids, **greedy), tiny().generate(ids, **greedy))  # transformers' own sdpa
    try:
        with kvpress.KnormPress(compression_ratio=0.5)(model):
            model.generate(ids, **greedy)
    except zt.IntegrationError as exc:
        print("refused:", exc)
    print("ok", kvpress.__file__)
""")


def kvpress_reachable() -> str | None:
    extra = os.environ.get("ATTNZOO_KVPRESS_PATH")
    paths = [*sys.path, extra] if extra else None
    spec = importlib.util.find_spec("kvpress") if paths is None else importlib.machinery.PathFinder.find_spec(
        "kvpress", paths)
    return None if spec is None else (spec.origin or "kvpress")


@pytest.mark.slow
@pytest.mark.parametrize("order", ["kvpress-first", "attnzoo-first"])
def test_kvpress_and_attnzoo_in_one_process(order, tmp_path):
    if kvpress_reachable() is None:
        pytest.skip("kvpress is not importable: install it beside attnzoo as docs/transformers.md says (pip install "
                    "--no-deps --target DIR kvpress ...; ATTNZOO_KVPRESS_PATH=DIR)")
    script = tmp_path / "run.py"
    script.write_text(KVPRESS_RUN)
    run = subprocess.run([sys.executable, str(script), order], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if run.returncode and "ModuleNotFoundError" in run.stderr and "import kvpress" in run.stderr:
        pytest.skip(f"kvpress does not import here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 1 and "a kvpress press (KnormPress) is hooked on this layer" in refused[0], run.stdout
    assert lines[-1].startswith("ok ")
