"""Labels shared by the interpretability tables (``explain``) and their HTML and PNG views
(``show``): a grid's position headings and a token id's text."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .errors import UsageError

__all__ = ["decoder", "position_labels"]


def position_labels(positions: Sequence[int], tokens: Sequence[str] | None) -> list[str]:
    """``"3"``, or ``"3 ' cat'"`` with the input's tokens (one per position of the input)."""
    if tokens is None:
        return [str(p) for p in positions]
    if isinstance(tokens, str) or not all(isinstance(t, str) for t in tokens):
        raise UsageError(f"tokens must be a list of strings, one per position, not {tokens!r}")
    if positions and max(positions) >= len(tokens):
        raise UsageError(
            f"tokens has {len(tokens)} strings; the grid reaches position {max(positions)}: "
            "give one token per position of the input"
        )
    return [f"{p} {tokens[p]!r}" for p in positions]


def decoder(tokenizer: Any) -> Callable[[int], str]:
    """Token id -> text: ``tokenizer.decode([id])`` (a Hugging Face tokenizer), a function of
    the id, or ``"#id"`` without one."""
    if tokenizer is None:
        return lambda i: f"#{i}"
    if callable(getattr(tokenizer, "decode", None)):
        return lambda i: str(tokenizer.decode([i]))
    if callable(tokenizer):
        return lambda i: str(tokenizer(i))
    raise UsageError(
        f"tokenizer must have a decode method or be a function of a token id, not {tokenizer!r}"
    )
