"""apply() says, in one line measured on a probe, when a spec changes what a pretrained model's attention computes
(issue 55: a user serving a pretrained checkpoint must know which specs keep its function)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnzoo.integrations import transformers as zt  # noqa: E402
from attnzoo.integrations.transformers.core import FUNCTION_TOLERANCE, function_change  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


def applied(spec):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zt.apply(model, spec)
    return model, [w for w in caught if w.category is zt.FunctionWarning]


@pytest.mark.parametrize("spec", ["vanilla", "h2o", "tova", "snapkv", "streaming", "knorm", "keydiff"])
def test_evictor_only_specs_keep_the_function_and_do_not_warn(spec):
    model, caught = applied(spec)
    assert caught == []
    core = model.model.layers[0].self_attn.attnzoo
    assert function_change(core, core.hf_call, "llama", "error", model.config) < 1e-6


@pytest.mark.parametrize("spec", ["selective", "selective-pruned", "alibi", "sink"])
def test_a_spec_that_changes_the_attention_warns_once_with_the_measured_change(spec):
    model, caught = applied(spec)
    assert len(caught) == 1, [str(w.message) for w in caught]
    line = str(caught[0].message)
    assert "\n" not in line and f"spec '{spec}'" in line and "evictor-only" in line
    core = model.model.layers[0].self_attn.attnzoo
    moved = function_change(core, core.hf_call, "llama", "error", model.config)
    assert moved > FUNCTION_TOLERANCE and f"{moved:.2g}" in line
    # what the line claims, on the model itself: its logits are not the plain model's
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids).logits - plain(ids).logits).abs().max() > 1e-3


def test_loading_a_checkpoint_saved_with_the_spec_does_not_warn_again(tmp_path):
    # its weights were saved with the spec (a fine-tune's, say): apply() warned when the spec was first applied, and
    # its measure (the spec against attention these weights never ran with) says nothing about them
    model, caught = applied("selective")
    assert len(caught) == 1
    model.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        loaded = zt.from_pretrained(str(tmp_path))
    assert not [w for w in again if w.category is zt.FunctionWarning]
    assert loaded.config.attnzoo["name"] == "selective"
    with warnings.catch_warnings(record=True) as fresh:  # apply() itself still warns
        warnings.simplefilter("always")
        zt.apply(loaded, "alibi")
    assert [w for w in fresh if w.category is zt.FunctionWarning]
