"""Exceptions of the public API. Each carries one line that names what was wrong and where."""

from __future__ import annotations


class AttnzooError(Exception):
    """Base class of attnzoo's own errors."""


class SpecError(AttnzooError, ValueError):
    """A spec file or mapping is malformed. The message is one line: ``source: field.path: reason``."""

    def __init__(self, source: str, reason: str, path: str = "") -> None:
        self.source = source
        self.path = path
        self.reason = reason
        where = f"{source}: {path}: " if path else f"{source}: "
        super().__init__(f"{where}{reason}")


class UnsupportedError(AttnzooError):
    """No backend (or not the requested one) can run a spec; ``reasons`` maps backend name to its reasons."""

    def __init__(self, spec_name: str, reasons: dict[str, list[str]], mode: str | None = None) -> None:
        self.reasons = reasons
        self.mode = mode
        parts = [f"{name}: {'; '.join(r)}" for name, r in reasons.items()]
        what = f" ({mode})" if mode else ""
        super().__init__(f"no backend can run spec '{spec_name}' here{what} ({' | '.join(parts)})")


class PluginError(AttnzooError):
    """A plugin registered something invalid (a duplicate name, a class that breaks the contract)."""


class RankDisagreementError(AttnzooError, ValueError):
    """The ranks of a context-parallel call were called differently (spec, transform parameters, options, dtype,
    sizes, grad mode): every rank raises the same one line naming what differs and each rank's value, before any
    collective that could hang on the difference."""
