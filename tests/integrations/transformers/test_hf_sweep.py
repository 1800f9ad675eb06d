"""The family sweep (attnzoo.integrations.transformers.sweep): every causal LM the installed transformers ships, built
tiny from its configuration (no downloads), with weights at a scale where attention patterns matter. After
``apply(model, "vanilla")`` each is either exact (the model's own eager logits within 1e-5 in float32 over a prompt
that crosses every window and chunk, each row of a left-padded batch as that row alone, greedy generation as eager's
alone and in the padded batch) or refused at apply() with one line naming the layer or the model. A family that
transformers cannot build tiny, or whose own eager model does not run on CPU, is skipped with the reason."""

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from attnzoo.integrations.transformers import sweep, sweep_models  # noqa: E402

pytestmark = [pytest.mark.release, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: one thread each is faster than sharing the cores, and two xdist workers do not fight."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", sweep.model_types())
def test_vanilla_is_the_models_attention_or_refused(model_type):
    result = sweep.run(model_type)
    if result.verdict == "cannot build":
        pytest.skip(f"{model_type}: {result.detail}")
    assert result.verdict in ("exact", "refused"), f"{model_type}: {result.verdict}: {result.detail}"
    if result.verdict == "refused":
        assert "\n" not in result.detail and result.detail.strip()
        assert result.named, f"{model_type}: the refusal names neither a layer nor the model: {result.detail}"


def test_the_configurations_are_tiny_and_cross_windows():
    cfg = sweep_models.config("llama4_text")  # chunked attention on 3 of every 4 layers: all four kept
    assert cfg.num_hidden_layers == 4 and cfg.attention_chunk_size == sweep_models.WINDOW
    assert sorted(set(cfg.layer_types)) == ["chunked_attention", "full_attention"]
    gemma = sweep_models.config("gemma3_text")  # 5 window layers to 1 full: the first of each kind
    assert gemma.layer_types == ["sliding_attention", "full_attention"]
    assert gemma.sliding_window == sweep_models.WINDOW
    gpt2 = sweep_models.config("gpt2")  # aliases: n_embd, n_head, n_layer
    assert (gpt2.n_embd, gpt2.n_head, gpt2.n_layer) == (64, 4, sweep_models.LAYERS)
    assert gpt2.vocab_size == sweep_models.VOCAB
    deepseek = sweep_models.config("deepseek_v3")  # latent attention: every head its keys, keys wider than values
    assert deepseek.num_key_value_heads == deepseek.num_attention_heads
    assert deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim > deepseek.v_head_dim
    assert min(sweep.PROMPT, *sweep.ROWS) >= 3 * sweep_models.WINDOW


def test_a_family_transformers_cannot_build_says_why():
    result = sweep.run("gemma4_assistant")
    assert result.verdict == "cannot build" and "transformers cannot build" in result.detail
