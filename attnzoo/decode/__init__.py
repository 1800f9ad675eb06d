"""Decoding with a cache: one owner for the decode step (docs/decoding.md, "Who owns what").

- :mod:`.storage` (with :mod:`.slots`): ``KVCache``, the cache's storage: rows, positions, per-token scores, padding,
  growth, removal, reordering, accounting. Its methods are the only writers of its fields.
- :mod:`.step`: the decode step: the full path's checks, admit (row maps, features, append), settle (the running
  F, the evictor's update), evict to the budget by the evictor's Python rule, window expiry; and the fast path.
- :mod:`.state`: what the full path validated for a cache (:class:`~.state.StepState`: spec, geometry, parameter
  fingerprint, the fast step chosen, a :class:`~.state.FastStep`).
- :mod:`.fast`: the fast steps a backend offers (``Backend.decode_step``): their preconditions and their torch
  form, which calls the evictor's own Python rule; :mod:`.fused` their C++ form (``fused_decode.cpp``, the torch
  ops ``attnzoo::*_step``, whose library :mod:`.fused_build` builds and loads), held to the Python rule by
  :func:`.check.check_fast_step`.

Nothing is imported here: ``import attnzoo`` stays light.
"""
