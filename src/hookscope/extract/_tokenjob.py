"""The forwards of ``unit="token"``: a :class:`~._job.Job` whose rows are the kept tokens.

Which tokens a batch keeps is known from its inputs before the forward (``_tokens.Rule``), so
each batch's samples and their tokens are placed in their blocks first; then each selected
layer's output ``(samples, tokens, ...)`` gives its kept rows with one ``index_select``,
written straight into the block's buffer on the CPU (``out=``: one copy, as ``hidden[mask]``
in a hand-written loop makes), or selected on the device and copied to pinned host memory
without waiting from CUDA. A block's buffers grow with the tokens it holds (doubling, so a
block is copied at most a few times before the buffers, handed back by the writer, fit).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UsageError
from ._job import Job, Shapes
from ._sources import Source
from ._tokens import Rule, Selection
from ._writer import Block, TokenBlock

__all__ = ["TokenJob"]


class TokenJob(Job):
    """One ``unit="token"`` extraction's settings and forwards (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        src: Source,
        layers: Any,
        batch_size: int,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        stop: bool,
        rule: Rule,
    ) -> None:
        super().__init__(model, src, layers, batch_size, None, dtype, device, stop)
        self.rule = rule
        self._sel: Selection | None = None
        self._index: dict[torch.device, Tensor] = {}  # the selection's indices per device
        self._per_block = 0  # the most tokens a finished block held (sizes new buffers)

    def spec(self) -> tuple[Any, ...]:
        return (
            self.src,
            self.names,
            self.batch_size,
            self.dtype,
            self.device,
            self.stop,
            self.rule,
        )

    def probe(self, strict: bool = False) -> Shapes:
        first = self.src.first()
        if first is None:
            return {}
        self._select(first, 1, None)
        return super().probe(strict)

    def length(self) -> int:
        """Tokens per sample in sample 0's batch of one (a packed row's context): what the
        default chunk is sized by."""
        first = self.src.first()
        return 1 if first is None else max(1, Rule().select(first, 1).length)

    def selections(self, chunk: int, blocks: set[int]) -> Iterator[tuple[int, Selection]]:
        """``(first sample, selection)`` of every batch of ``blocks``, read without a forward
        (the multi-process engines count each block's tokens with them)."""
        for start, ids, x, ok in super()._batches(chunk, blocks.__contains__):
            yield start, self._select(x, len(ids), ok)

    # -- placing ----------------------------------------------------------------------------------
    def _batches(
        self, chunk: int, wanted: Callable[[int], bool]
    ) -> Iterator[tuple[int, list[str], Any, list[bool]]]:
        for start, ids, x, ok in super()._batches(chunk, wanted):
            if x is not None:
                self._select(x, len(ids), ok)
            yield start, ids, x, ok

    def _select(self, x: Any, n: int, ok: list[bool] | None) -> Selection:
        self._sel = self.rule.select(x, n, ok)
        self._index = {}
        return self._sel

    def _block(self, index: int, start: int, capacity: int, buffers: dict[str, Tensor]) -> Block:
        return TokenBlock(index, start, capacity, buffers)

    def _place(self, start: int, ids: list[str], ok: list[bool], *args: Any) -> Any:
        places = super()._place(start, ids, ok, *args)
        sel = self._sel
        for p in places:
            block = p.block
            assert isinstance(block, TokenBlock)
            assert sel is not None
            p.token_src = a = sel.before[p.src]
            p.tokens = sel.before[p.src + p.count] - a
            p.token_at, block.count = block.count, block.count + p.tokens
            block.columns.append(
                (
                    sel.sample[a : a + p.tokens] + start,
                    sel.position[a : a + p.tokens],
                    sel.token_id[a : a + p.tokens],
                )
            )
        return places

    def _finished(self, block: Block) -> Block:
        assert isinstance(block, TokenBlock)
        self._per_block = max(self._per_block, block.count)
        return super()._finished(block)

    def _buffer(self, block: Block, name: str) -> Tensor:
        """A layer's buffer; where no batch of the block gave it rows (none kept a token), one
        of no rows."""
        if name in block.buffers:
            return block.buffers[name]
        if name not in self.shapes:
            raise UsageError("no sample of the first batch could be read (see errors)")
        row, dtype = self.shapes[name]
        block.buffers[name] = torch.empty((0, *row), dtype=dtype)
        return block.buffers[name]

    def _rows_of(self, block: TokenBlock, name: str, need: int, filled: int) -> Tensor:
        """The block's buffer for ``name`` with room for ``need`` rows, its first ``filled``
        kept when it grows."""
        buffer = block.buffers.get(name)
        if buffer is not None and len(buffer) >= need:
            return buffer
        row, dtype = self.shapes[name]
        guess = math.ceil(need * block.capacity / max(block.rows, 1) * 1.1)
        size = max(need, self._per_block, guess, 2 * len(buffer) if buffer is not None else 0)
        grown = torch.empty((size, *row), dtype=dtype, pin_memory=self._pinned)
        if buffer is not None and filled:
            if self._pinned:  # copies from the device into the old buffer may be under way
                torch.cuda.current_stream(self.device).synchronize()
            grown[:filled].copy_(buffer[:filled])
        block.buffers[name] = grown
        return grown

    # -- one forward ------------------------------------------------------------------------------
    def _deliver(self, name: str, output: Tensor) -> None:
        """A layer's output: the kept tokens' rows, into their blocks' buffers."""
        sel = self._sel
        assert sel is not None
        start, stop = self._span
        flat = self._flat(name, output, stop - start, sel.length)
        row = tuple(flat.shape[1:])
        index = self._index.get(flat.device)
        if index is None:
            index = self._index[flat.device] = sel.index.to(flat.device, non_blocking=True)
        same = self.dtype in (None, flat.dtype) and flat.dtype != torch.bfloat16
        dtype = flat.dtype if same else self._rows(name, flat[:0], 0, None).dtype
        known = self.shapes.setdefault(name, (row, dtype))
        if known[0] != row:
            raise UsageError(
                f"layer {name!r} gives token rows of shape {row} for samples {start}.."
                f"{stop - 1} but {known[0]} for earlier ones: a store holds one shape per layer"
            )
        places = [p for p in self._places if p.tokens]
        if same and len(places) == 1 and flat.device.type == "cpu":
            p = places[0]  # the usual case: straight into the block's buffer, one copy
            block = p.block
            assert isinstance(block, TokenBlock)
            target = self._rows_of(block, name, p.token_at + p.tokens, p.token_at)
            part = index[p.token_src : p.token_src + p.tokens]
            torch.index_select(flat, 0, part, out=target[p.token_at : p.token_at + p.tokens])
            return
        rows = flat.index_select(0, index)
        rows = rows if same else self._rows(name, rows, len(rows), None)
        for p in places:
            block = p.block
            assert isinstance(block, TokenBlock)
            target = self._rows_of(block, name, p.token_at + p.tokens, p.token_at)
            target[p.token_at : p.token_at + p.tokens].copy_(
                rows[p.token_src : p.token_src + p.tokens], non_blocking=self._pinned
            )

    def _flat(self, name: str, output: Tensor, n: int, length: int) -> Tensor:
        """``output`` as ``(samples * tokens, ...)``, checked to be ``(n, length, ...)``."""
        if output.is_nested:  # TransformerEncoder's fast path: padded back to the inputs
            parts = output.unbind()
            size = (len(parts), length, *parts[0].shape[1:]) if parts else None
            output = torch.nested.to_padded_tensor(output, 0.0, size)
        if output.dim() < 2 or tuple(output.shape[:2]) != (n, length):
            raise UsageError(
                f"layer {name!r} returned shape {tuple(output.shape)} for a batch of {n} "
                f"samples of {length} tokens: unit='token' keeps rows along its first two "
                "dimensions (samples, tokens). Choose a layer whose output is per token (a "
                "block's hidden states, not a pooled output or attention weights), or use "
                "unit='sample'"
            )
        return output.detach().flatten(0, 1)
