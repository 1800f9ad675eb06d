"""Deliberately wrong implementations, each reproducing a bug seen in public re-implementations (or a classic
kernel bug). Tests run the project's checks on them and assert that each is caught."""

import types

import torch

import attnzoo
from attnzoo.backends.reference import ReferenceBackend
from attnzoo.evictors.base import pick
from attnzoo.evictors.builtin import Selective
from attnzoo.registry import new_registry
from attnzoo.transforms.selective import SelectiveMask


class CumsumOverKeys(ReferenceBackend):
    """Accumulates the selection along the key axis instead of the query axis."""

    name = "broken_cumsum_keys"

    def accumulate(self, selection):
        return torch.nn.functional.pad(selection[..., :-1].cumsum(dim=3), (1, 0))


class NoShift(ReferenceBackend):
    """Off by one: F[i] includes query i's own selection (sum over k <= i)."""

    name = "broken_no_shift"

    def accumulate(self, selection):
        return selection.cumsum(dim=2)


class ZeroFDecoding(ReferenceBackend):
    """Computes F from the current row only during cached decoding, so F = 0."""

    name = "broken_zero_f_decode"

    def carry(self, cache):
        return None


class CollapsedPosition(ReferenceBackend):
    """The SSA authors' cached-decoding bug: the query position restarts at 1 in every decode call."""

    name = "broken_position_collapse"

    def query_positions(self, cache, count, batch):
        return torch.arange(1, count + 1, device=cache.keys.device).expand(batch, count)


class MissingScale(ReferenceBackend):
    """Forgets the 1/sqrt(D) logit scale."""

    name = "broken_missing_scale"

    def attend(self, plan, q, k, v, qpos, kpos, params, key_mask=None, carry=None):
        d = q.shape[-1]
        return super().attend(plan, q * d ** 0.5, k, v, qpos, kpos, params, key_mask, carry)


class LastBlockUnwritten(ReferenceBackend):
    """A kernel that never writes the last key block of a row: the output buffer keeps its NaN fill there."""

    name = "broken_last_block"

    def forward(self, plan, q, k, v, params, positions, key_mask, return_accumulated=False):
        result = super().forward(plan, q, k, v, params, positions, key_mask, return_accumulated)
        out = result[0] if return_accumulated else result
        n = out.shape[2]
        block = 16
        if n > block:
            start = (n - 1) // block * block
            out = torch.cat([out[:, :, :start], torch.full_like(out[:, :, start:], float("nan"))], dim=2)
        return (out, result[1]) if return_accumulated else out


class TemperatureOnKeys(ReferenceBackend):
    """Applies the query temperature to the keys' rows (positions of keys, key rows) instead of the queries."""

    name = "broken_temperature_on_keys"

    def attend(self, plan, q, k, v, qpos, kpos, params, key_mask=None, carry=None):
        transform = plan.one(attnzoo.Slot.QUERY)
        if transform is None:
            return super().attend(plan, q, k, v, qpos, kpos, params, key_mask, carry)
        scale = transform.scale(k, kpos, params[transform.kind]).unsqueeze(-1)
        swapped = types.SimpleNamespace(**vars(plan))
        swapped.one = lambda slot: None if slot == attnzoo.Slot.QUERY else plan.one(slot)
        swapped.many = plan.many
        swapped.logit_scale = plan.logit_scale
        return super().attend(swapped, q, k * scale, v, qpos, kpos, params, key_mask, carry)


class PaddingQueriesScored(ReferenceBackend):
    """Counts every new token of a step as a query of its row: the padding queries' attention rows go to the
    evictor and their selections stay in F (attnzoo's own settle did so until issue 51: each padding query of a
    left-padded prompt sees only its row's first real token, and added its attention to that token's H2O score).

    Since issue 54 a backend only attends (the step settles), so the bug is planted where it was: the cache is told
    "no query is padding" for the attention and for the settle after it (the patch stays on the cache: the next
    step's attention sets it again)."""

    name = "broken_padding_queries_scored"

    def attend_held(self, plan, step, cache, params, *, want_probs=False):
        cache.query_mask = lambda: None
        return super().attend_held(plan, step, cache, params, want_probs=want_probs)


class BosUnprotected(SelectiveMask):
    """selective_mask that lets BOS be masked whatever protect_bos says."""

    def selection(self, logits, allowed, ctx, params):
        keep = allowed & (ctx.kpos != ctx.qpos)
        return torch.where(keep, torch.relu(logits), torch.zeros((), dtype=logits.dtype))


class EvictsBosOnTie(Selective):
    """Evicts the largest F among ALL tokens: on an all-zero tie the oldest, i.e. BOS, goes first."""

    def victim(self, cache):
        everything = torch.ones_like(cache.positions, dtype=torch.bool)
        return pick(cache.state["accumulated"], everything, cache.positions, largest=True)


class EvictsNewest(Selective):
    """Evicts the newest token instead of the one with the largest F."""

    def victim(self, cache):
        return cache.positions.argmax(-1)


BROKEN_BACKENDS = (CumsumOverKeys, NoShift, ZeroFDecoding, CollapsedPosition, MissingScale, LastBlockUnwritten,
                   TemperatureOnKeys, PaddingQueriesScored)


def registry_with_broken_backends():
    """A registry with the built-ins plus every broken backend (an isolated one; the default is untouched)."""
    module = types.ModuleType("broken_backends")
    module.register_backends = attnzoo.hookimpl(lambda register: [register(cls()) for cls in BROKEN_BACKENDS])
    return new_registry(entry_points=False, extra_plugins=[("broken_backends", module)])


def registry_replacing(builtin_name, broken_cls, category="transforms"):
    """A registry whose built-in ``builtin_name`` is replaced by ``broken_cls`` (same kind name)."""
    reg = new_registry(entry_points=False)
    broken = type(broken_cls.__name__, (broken_cls,), {"kind": builtin_name})
    getattr(reg, category)[builtin_name] = broken
    reg._spec_model = None
    for name, spec in list(reg.specs.items()):
        reg.specs[name] = attnzoo.load_spec(spec.model_dump(), registry=reg)
    return reg
