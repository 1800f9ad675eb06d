"""The one home of the attention maths and of the contracts every layer shares (docs/architecture.md).

- :mod:`.contract`: the backend contract (:class:`~.contract.Backend`, :class:`~.contract.Mode`); its public path
  is ``attnzoo.backends.base``.
- :mod:`.numerics`: the accumulator's wide dtype and the running F's state key.
- :mod:`.composition`: the steps every backend computes the same way on a plan (row maps, context, features,
  allowed pairs, the selection, the sink, key bounds, the logit scale).

``attnzoo.core`` imports only ``attnzoo.transforms.base`` (the transforms' types) and ``attnzoo.errors``; every
other package imports it, never the reverse (the import contract in ``.importlinter``). The reference backend
(``attnzoo/backends/reference.py``) does not use it: it is the oracle, written on its own.

Nothing is imported here: ``import attnzoo`` stays light.
"""
