"""Context-parallel attention: one sequence sharded over the ranks of a ``torch.distributed`` process group
(gloo on CPU, NCCL on GPU), for any spec the path accepts (docs/distributed.md).

Layout: the sequence is cut into 2R chunks and rank r holds chunks r and 2R-1-r (``balanced``, so that every rank
has the same causal work), or into R contiguous chunks. :func:`shard` and :func:`unshard` move tensors between the
two forms, :meth:`Layout.positions` gives each rank its tokens' true 1-based positions, which every transform sees
(SSA's log(i), ALiBi's distances, windows and the selective BOS are exact).

Keys and values (after the key and value row maps) go around the ring, one rank's block per step, sent while the
previous one is attended (``method="ring"``: O(N / R) attention state per rank), or are all-gathered
(``"allgather"``; ``"auto"`` all-gathers when the gathered keys and values are under ``gather_limit`` bytes). Each
(query chunk, key chunk) pair is computed in query blocks of ``block_size`` and merged flash-style by log-sum-exp;
the normaliser's sink joins at the end. The backward pass recomputes every pair and sends the key and value
gradients around the ring with the blocks, home at the end.

The selective accumulator: the carry of a key at the start of query chunk c is the sum of the selection S over
every earlier query chunk, an exclusive scan in sequence order of the per-chunk column sums (a selector-only ring
first, then a chain through the chunks' owners). Backward, the reverse carry: the gradient reaching F of the
chunks after c is scanned back (a suffix sum in sequence order) into c's column sums, so the selector's query and
key rows of early chunks get the gradient of every later chunk's F. Cumulative per-token features (the forgetting
gate's running sum) are offset by the same kind of scan of per-chunk totals.

Gradients: q, k, v and per-token inputs get this rank's tokens' gradients. The transforms' parameters are
replicated; each rank's gradient is its own queries' contribution, and the sum over the ranks is the full
gradient: :func:`sum_gradients` (or the data-parallel wrapper that sums the model's other replicated weights)
adds them up, exactly as for the model's q/k/v projections.

Every call first all-gathers a fixed-size fingerprint of itself (spec, transform parameters, options, grad mode,
dtype, sizes): ranks that disagree raise the same one line (:class:`RankDisagreementError`) before any collective
that could hang.

Declined (:class:`attnzoo.UnsupportedError`, one line naming spec and cause): an accumulator whose selection is
not declared pointwise (``AccumulatorTransform.pointwise``: S is computed one key block at a time), ``key_mask``,
``documents`` and ``return_accumulated`` (F is (B, N, N)). Decoding is not sharded (evictors act in decoding only).

What computes the pairs (``ContextParallel.last_pairs``): torch's CPU flash kernel for plain pairs, the blocked
backend's fused selective kernel (``fused``), the triton backend's generated kernels (``kernel_pairs``: on CUDA
under ``backend="auto"``, or when ``backend="triton"`` is asked for, which declines in one line what they cannot
run), else the eager pairs. CUDA tensors on a gloo group cross through host memory (several ranks sharing one
GPU).

The parts, one module each: ``layout`` (where the tokens are), ``exchange`` (what crosses between ranks),
``pairs`` (one query block against one key range), ``fused`` and ``kernel_pairs`` (the pairs on the backends'
kernels), ``carry`` (the scans across shard boundaries), ``attend`` (forward and backward as one autograd
function) and ``module`` (the public entry points).

This package never imports the reference backend.
"""

from __future__ import annotations

from ..errors import RankDisagreementError
from .exchange import CommCounter, counting
from .layout import Layout, shard, shard_positions, unshard
from .module import ContextParallel, ShardedAttention, sum_gradients, unsupported

__all__ = ["CommCounter", "ContextParallel", "Layout", "RankDisagreementError", "ShardedAttention", "counting", "shard",
           "shard_positions", "sum_gradients", "unshard", "unsupported"]
