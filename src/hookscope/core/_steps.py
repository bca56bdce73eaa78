"""Generation steps: which forward of the model a call belongs to, and the token positions
that forward covered.

A session counts the top-level forwards of the model from 0 (its pass index). Under
``model.generate(...)`` each forward is one step: 0 is the prefill over the prompt, then one
forward per new token. ``steps=`` on ``hs.capture`` and ``hs.edit`` selects those forwards.

The positions a forward covers are columns of its ``attention_mask``: with a KV cache the
forward gets the mask of the whole sequence so far and only the new tokens, which are its
last columns. Under left padding a column is not a sample's token index: that is
``attention_mask.cumsum(-1) - 1`` at the column (the ``position_ids`` generate gives).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

from torch import Tensor

from ..errors import UsageError

__all__ = ["Spans", "Steps", "span_of", "steps_of"]

Steps: TypeAlias = int | Sequence[int] | range
"""The type of ``steps=``: a forward's number (0: the prefill), a list of them, or a range."""


def steps_of(value: Steps | None) -> frozenset[int] | None:
    """The steps asked for, checked: non-negative ints, each once, at least one."""
    if value is None:
        return None
    items = [value] if isinstance(value, int) else value
    fix = "give an int, a list of ints or a range of them (0 is the prefill of generate())"
    if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, range)):
        raise UsageError(f"steps={value!r}: {fix}")
    if not items or not all(isinstance(s, int) and not isinstance(s, bool) for s in items):
        raise UsageError(f"steps={value!r}: {fix}, at least one")
    if any(s < 0 for s in items):
        raise UsageError(
            f"steps={value!r}: a step counts the model's forwards from 0, so it cannot be "
            "negative; give the step numbers themselves (e.g. range(3, 6))"
        )
    if len(set(items)) != len(items):
        raise UsageError(f"steps={value!r} names a step twice; give each once")
    return frozenset(items)


def span_of(inputs: dict[str, Any]) -> range | None:
    """The mask columns of the tokens a forward got: its last ``T`` columns for ``T`` input
    tokens (``input_ids`` or ``inputs_embeds``); without a mask, after what its KV cache holds
    (``get_seq_length()``). None for a forward without token inputs. Shapes only: no device
    synchronisation."""
    ids, embeds = inputs.get("input_ids"), inputs.get("inputs_embeds")
    if isinstance(ids, Tensor) and ids.dim() >= 1:
        count = ids.size(-1)
    elif isinstance(embeds, Tensor) and embeds.dim() >= 2:
        count = embeds.size(-2)
    else:
        return None
    mask = inputs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.size(1) >= count:
        return range(mask.size(1) - count, mask.size(1))
    past = 0
    for name in ("past_key_values", "cache"):
        length = getattr(inputs.get(name), "get_seq_length", None)
        if callable(length):
            past = int(length())
            break
    return range(past, past + count)


class Spans:
    """The positions of each recent forward, by pass index; ``limit`` passes at most (the
    oldest are forgotten: records no longer hold their calls)."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._spans: dict[int, range | None] = {}

    def note(self, pass_index: int, span: range | None) -> None:
        spans = self._spans
        spans[pass_index] = span
        if self._limit is not None and len(spans) > self._limit:
            spans.pop(next(iter(spans)), None)  # (another thread's forward may race here)

    def get(self, pass_index: int) -> range | None:
        return self._spans.get(pass_index)
