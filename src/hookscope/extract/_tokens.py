"""``unit="token"``: which tokens of a batch become rows, and where each one came from.

A token is real where the batch's ``attention_mask`` is 1 (or its ``src_key_padding_mask`` is
false; every token of a batch without either). Its ``position`` is its index among its
sample's real tokens, so that left and right padding give the same positions. A :class:`Rule`
then drops the real tokens whose id is in ``drop`` (BOS, special tokens) and those outside a
position range (``positions=(1, None)`` skips each sample's first token, as SAE pipelines
often do). What is kept depends on the inputs alone, never on the model: the multi-process
engines count each block's tokens before any forward runs (:func:`count`), which places every
block's rows in the store before it is computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core import keep_mask
from ..errors import UsageError

__all__ = ["Rule", "Selection"]


@dataclass(frozen=True)
class Selection:
    """The kept tokens of a batch of ``n`` samples of ``length`` tokens, in (sample, position)
    order: their flat indices into the ``(n * length)`` tokens, their sample (within the
    batch), position and token id (-1 without ``input_ids``), and how many each sample
    keeps (``counts``, with ``before[i]`` the kept tokens of the samples before ``i``)."""

    length: int
    index: Tensor
    sample: Tensor
    position: Tensor
    token_id: Tensor
    before: list[int]

    @property
    def kept(self) -> int:
        return len(self.index)


@dataclass(frozen=True)
class Rule:
    """What ``unit="token"`` keeps (see the module's docstring)."""

    drop: tuple[int, ...] = ()
    start: int = 0
    stop: int | None = None

    @classmethod
    def of(cls, drop_token_ids: Iterable[int] | None, positions: Any) -> Rule:
        """The rule of ``hs.extract``'s arguments, checked."""
        drop: tuple[int, ...] = ()
        if drop_token_ids is not None:
            values = list(drop_token_ids)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise UsageError(
                    f"drop_token_ids must be token ids (ints), e.g. tokenizer.all_special_ids, "
                    f"got {drop_token_ids!r}"
                )
            drop = tuple(sorted(set(values)))
        if positions is None:
            return cls(drop)
        if (
            not isinstance(positions, (tuple, list))
            or len(positions) != 2
            or not _index(positions[0])
            or not (positions[1] is None or _index(positions[1]))
        ):
            raise UsageError(
                f"positions must be (start, stop) with ints >= 0 (stop None: to the end), e.g. "
                f"(1, None) to skip each sample's first token; got {positions!r}"
            )
        return cls(drop, positions[0], positions[1])

    def meta(self) -> dict[str, Any]:
        return {"drop_token_ids": list(self.drop), "positions": [self.start, self.stop]}

    def select(self, inputs: Any, n: int, ok: list[bool] | None = None) -> Selection:
        """The kept tokens of one batch's model inputs (samples not ``ok`` keep none)."""
        mask, ids = _tokens(inputs, n)
        if self.drop and ids is None:
            raise UsageError(
                "drop_token_ids needs the token ids: the inputs have no 'input_ids' (nor are "
                "they a 2-d tensor of token ids)"
            )
        position = mask.long().cumsum(1) - 1
        keep = mask & (position >= self.start)
        if self.stop is not None:
            keep &= position < self.stop
        if self.drop and ids is not None:
            keep &= ~torch.isin(ids, torch.tensor(self.drop, dtype=ids.dtype))
        if ok is not None and not all(ok):
            keep &= torch.tensor(ok, dtype=torch.bool)[:, None]
        index = keep.reshape(-1).nonzero().squeeze(1)
        length = mask.shape[1]
        before = [0, *keep.sum(1).cumsum(0).tolist()]
        token_id = (
            ids.reshape(-1)[index].to(torch.int32)
            if ids is not None
            else torch.full((len(index),), -1, dtype=torch.int32)
        )
        return Selection(
            length,
            index,
            (index // max(length, 1)),
            position.reshape(-1)[index].to(torch.int32),
            token_id,
            before,
        )


def _index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tokens(inputs: Any, n: int) -> tuple[Tensor, Tensor | None]:
    """``(mask, ids)`` of a batch on the CPU: which tokens are real, and their ids."""
    ids: Tensor | None = None
    if isinstance(inputs, Mapping):
        found = inputs.get("input_ids")
        ids = found if isinstance(found, Tensor) and found.dim() == 2 else None
    elif isinstance(inputs, Tensor) and inputs.dim() == 2 and not inputs.is_floating_point():
        ids = inputs
    mask = keep_mask(inputs)
    if mask is None and ids is None:
        raise UsageError(
            "unit='token' needs token inputs: a mapping with 'input_ids' or an "
            "'attention_mask' (a tokenizer's output), or a 2-d tensor of token ids; these "
            f"inputs are {_describe(inputs)}"
        )
    if mask is None:
        assert ids is not None
        mask = torch.ones(ids.shape, dtype=torch.bool)
    mask, ids = mask.cpu().bool(), ids.cpu() if ids is not None else None
    if len(mask) != n or (ids is not None and ids.shape != mask.shape):
        raise UsageError(
            f"the attention mask has shape {tuple(mask.shape)} and the token ids "
            f"{tuple(ids.shape) if ids is not None else None} for a batch of {n} samples: they "
            "must be (samples, tokens), the same shape"
        )
    return mask, ids


def _describe(inputs: Any) -> str:
    if isinstance(inputs, Tensor):
        return f"a tensor {tuple(inputs.shape)} {inputs.dtype}"
    if isinstance(inputs, Mapping):
        return f"a mapping of {sorted(inputs)}"
    return type(inputs).__name__


def count(selections: Iterable[tuple[int, Selection]], chunk: int) -> dict[int, int]:
    """``{block: kept tokens}`` from the selections of batches (``(first sample, selection)``)
    that each lie in one block of ``chunk`` samples."""
    found: dict[int, int] = {}
    for start, sel in selections:
        found[start // chunk] = found.get(start // chunk, 0) + sel.kept
    return found
