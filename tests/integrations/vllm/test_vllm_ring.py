"""The ring page's typed views (attnzoo.integrations.vllm.ring, docs/vllm.md "KV pruning"): the views of every page
at once (``all_views``, what the serving layer batches with) are the same bytes as one page's ``views``. Needs vLLM
(ring.py subclasses its spec classes); no engine starts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_pages_views_are_each_pages_bytes(dtype):
    from attnzoo.integrations.vllm.ring import RingGeometry

    geometry = RingGeometry(2, 8, dtype, 5, ("F", "score"), torch.float32, 128)
    blocks = 4
    words = geometry.page_bytes // torch.empty((), dtype=dtype).element_size() + 4  # a block longer than the page
    cache = torch.randn(blocks, words, generator=torch.Generator().manual_seed(0)).to(dtype)
    every = geometry.all_views(cache)
    assert set(every) == {"hdr", "keys", "values", "positions", "state.F", "state.score"}
    for block in range(blocks):
        one = geometry.views(cache[block])
        for name, view in one.items():
            mine = every[name][block] if name == "hdr" else every[name][block:block + 1]
            assert mine.shape == view.shape and mine.dtype == view.dtype and mine.data_ptr() == view.data_ptr()
            assert mine.stride()[-1] == 1
    every["keys"].index_copy_(0, torch.tensor([2]), torch.ones(1, 2, 6, 8, dtype=dtype))  # written in place
    assert bool((geometry.views(cache[2])["keys"] == 1).all())
    assert not bool((geometry.views(cache[1])["keys"] == 1).all())
    with pytest.raises(ValueError, match="contiguous"):
        geometry.all_views(cache.t())
