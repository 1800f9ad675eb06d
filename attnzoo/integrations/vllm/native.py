"""The row maps of a layer that vLLM's own CPU kernel runs: a spec that is the layer's native attention over rows
mapped token by token (:func:`.spec.native_rows`: vanilla, SSA's temperatures, QK-norm, a plugin's row map). The
step's queries go through the spec's query maps before the kernel, its keys and values through the key and value
maps before vLLM writes them into its pages (``backend.AttnzooCPUImpl``), the kernel's outputs through the output
maps after it; each token at its position (:meth:`.step.Step.positions`)."""

from __future__ import annotations

from ...transforms.base import Slot
from .spec import ROW_SLOTS
from .step import step_of


class RowMaps:
    """The row maps of :class:`~.layer.Layer` ``layer`` (its plan and parameters, ``layer.grouped``) on the flat
    rows vLLM hands its attention impl: (n, heads, D) for the step's ``n`` tokens."""

    def __init__(self, layer) -> None:
        self.layer = layer
        #: the row slots the spec maps (a slot with none hands its rows on unchanged)
        self.mapped = frozenset(slot for slot in ROW_SLOTS if layer.plan.many(slot))
        #: the parameters as the row maps take them (``layer.grouped``), by (dtype, device): made once, the layer's
        #: parameters being loaded before its first step and fixed after it (``load_layer``)
        self._grouped: dict[tuple, dict] = {}

    def inputs(self, query, key, value, meta):
        """The step's queries (n, H, D), keys and values (n, H_kv, D) through the spec's query, key and value maps,
        for vLLM's kernel; the rows themselves where a slot maps nothing."""
        if not self.mapped:
            return query, key, value
        step = step_of(meta)
        grouped = self._params(query)
        return tuple(self._rows(slot, rows, step, grouped) for slot, rows in
                     ((Slot.QUERY, query), (Slot.KEY, key), (Slot.VALUE, value)))

    def output(self, output, meta) -> None:
        """vLLM's kernel's output rows (the step's first ``n`` of ``output``) through the spec's output maps, in
        place."""
        if Slot.OUTPUT not in self.mapped:
            return
        n, layer = meta.num_actual_tokens, self.layer
        out = output[:n].view(n, layer.heads, layer.head_dim)
        out.copy_(self._rows(Slot.OUTPUT, out, step_of(meta), self._params(out)))

    def _params(self, rows):
        """The row maps' parameters for rows (n, H, D) of this dtype and device (the spec has no per-token inputs:
        ``spec.declined`` refuses them, so they depend on nothing else)."""
        key = (rows.dtype, rows.device)
        grouped = self._grouped.get(key)
        if grouped is None:
            grouped = self._grouped[key] = self.layer.grouped(rows.transpose(0, 1).unsqueeze(0))
        return grouped

    def _rows(self, slot, rows, step, grouped):
        """Rows (n, Hx, D) of the step's tokens through ``slot``'s row maps at their positions."""
        if slot not in self.mapped:
            return rows
        positions = step.positions(rows.device).unsqueeze(0).unsqueeze(0)  # (1, 1, n)
        mapped = self.layer.plan.composition.row_scale(slot, rows.transpose(0, 1).unsqueeze(0), positions, grouped)
        return mapped[0].transpose(0, 1)
