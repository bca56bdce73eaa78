"""One extraction's forwards: batches of the source through the model, each selected layer's
rows copied straight from its hook into the host buffers of the blocks they belong to (one
copy; pinned and non-blocking from CUDA, so the forwards never wait for the host).

On the CPU, where a block is exactly one batch, the rows are not copied at all: the block holds
the tensor itself, as a hand-written loop that saves each output would. That is safe when
nothing changes it later: it is not the model's own storage (a parameter, a buffer, a tensor
attribute), and its version counter is checked after the forward: a layer whose output the
forward changed in place after the hook (an in-place ReLU downstream) has that batch run again,
copied from then on.

Shared by both engines: the local one hands the finished blocks to a writer thread, a Ray
actor writes the block it was given.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .._progress import Advance
from ..core import (
    HookSet,
    ModuleCall,
    Session,
    StopForward,
    _torch,
    call_model,
    leaves,
    map_tensors,
    own_forward,
    run_eagerly,
    training_mode,
)
from ..errors import CaptureError, UnsupportedModelError, UsageError
from ._rows import Rows, keep_mask
from ._sources import Batches, Source
from ._writer import Block, pinned

__all__ = ["Job", "Tap", "floating_dtype"]

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Tap(Session):
    """The hooks of an extraction: each selected layer's call hands its output's first tensor
    to ``deliver``; with ``stop`` the forward ends once every layer has done so."""

    _entry = "hs.extract"

    def __init__(self, model: nn.Module, layers: Any, stop: bool) -> None:
        # the forwards are ours: compiled code runs eagerly, only this thread's are seen
        super().__init__(model, recompile=True, this_thread=True)
        sites = self.layers.sites(layers)  # layers and operation sites ("layer::op")
        self.chosen = {name: site.module for name, site in sites.items()}
        self._layers_only = {n: s.module for n, s in sites.items() if s.op is None}
        self._watch_ops(sites)
        self._stop = stop
        self._seen: set[str] = set()
        self.deliver: Callable[[str, Tensor], None] = lambda name, t: None

    def _install(self, hooks: HookSet) -> None:
        self._track(hooks, self._layers_only)

    def _new_pass(self) -> None:
        self._seen = set()

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> Any:
        if call.name in self._seen:
            raise CaptureError(
                f"layer {call.name!r} ran more than once in one forward; a feature store keeps "
                "one value per layer and sample. Select a layer that runs once (or use "
                "hookscope.capture() to get every call)."
            )
        tensor = next((t for _, t in leaves(output)), None)
        if tensor is None:
            raise CaptureError(f"layer {call.name!r} returned no tensor ({type(output).__name__})")
        self.deliver(call.name, tensor)
        self._seen.add(call.name)
        if self._stop and len(self._seen) == len(self.chosen):
            raise StopForward(self)
        return None

    def missing(self) -> list[str]:
        return [name for name in self.chosen if name not in self._seen]


@dataclass
class _Place:
    """Rows ``src .. src+count-1`` of a batch go to rows ``at ..`` of ``block``."""

    block: Block
    at: int
    src: int
    count: int
    tokens: int = 0  # unit="token": the kept tokens of these samples,
    token_src: int = 0  # which of the batch's kept tokens they are,
    token_at: int = 0  # and where they go in the block's rows


class Job:
    """One extraction's settings and forwards (see the module's docstring)."""

    def __init__(
        self,
        model: nn.Module,
        src: Source,
        layers: Any,
        batch_size: int,
        reduce: Any,
        dtype: torch.dtype | None,
        device: torch.device | str | None,
        stop: bool,
    ) -> None:
        self.model, self.src, self.batch_size, self.reduce = model, src, batch_size, reduce
        src.floats = floating_dtype(model)  # NumPy's float64 into a float32 model: cast
        self.tap = Tap(model, layers, stop)  # fails now for an unknown layer
        self.names = list(self.tap.chosen)
        self.dtype, self.stop = dtype, stop
        first = next(iter(model.parameters()), None)
        self.device = (
            torch.device(device)
            if device is not None
            else (first.device if first is not None else torch.device("cpu"))
        )
        self.shapes: Shapes = {}  # layer -> (row shape, dtype), from the first rows seen
        self.samples = 0  # how many samples the source had (set by blocks())
        self._rows = Rows(reduce, dtype)
        self._pinned = pinned(self.device)
        self._open: dict[int, Block] = {}
        self._size = 1
        self._held: list[tuple[str, Tensor, int]] = []  # (layer, rows, version) of this forward
        self._copied: set[str] = set()  # layers whose outputs the forward changes later
        self._owned: set[int] | None = None  # storages the model holds (see _can_hold)
        self._places: list[_Place] = []
        self._mask: Tensor | None = None
        self._span = (0, 0)

    def spec(self) -> tuple[Any, ...]:
        """What a Ray actor needs besides the model to build the same job."""
        return (
            self.src,
            self.names,
            self.batch_size,
            self.reduce,
            self.dtype,
            self.device,
            self.stop,
        )

    def expect(self, stored: dict[str, tuple[tuple[int, ...], Any]]) -> None:
        """Row shapes of a store being resumed: every new row must match them."""
        import numpy as np

        for name, (row, dtype) in stored.items():
            self.shapes[name] = (row, torch.from_numpy(np.zeros(0, dtype)).dtype)

    def probe(self, strict: bool = False) -> Shapes:
        """Row shapes and dtypes from sample 0 alone; ``{}`` for a source without samples, or
        (unless ``strict``) a model that fails on one sample (one made for a fixed batch
        size): the batches then say what is wrong. A refusal of the model is raised."""
        first = self.src.first()
        if first is None:
            return {}
        kept, self.shapes = self.shapes, {}
        try:
            with self.running():
                self._forward(first, 1, [], 0)
            return self.shapes
        except UnsupportedModelError:
            raise  # a refusal of the model (a torch.func transform...): no batch would do better
        except Exception:
            if strict:
                raise
            return {}
        finally:
            self.shapes = kept

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Hooks in, eval mode, no autograd, compiled code run eagerly; all undone after."""
        with (
            training_mode(self.model, False),
            torch.no_grad(),
            run_eagerly(self.model),
            own_forward(),  # the user's open sessions do not see extract's forwards
            self.tap,
        ):
            self.tap.deliver = self._deliver
            yield

    # -- blocks -----------------------------------------------------------------------------------
    def blocks(
        self,
        chunk: int,
        wanted: Callable[[int], bool],
        buffers: Callable[[], dict[str, Tensor]],
        advance: Advance,
    ) -> Iterator[Block]:
        """Every wanted block, computed and finished (inside :meth:`running`)."""
        n = self.src.length() if self.src.addressable else None
        self._size = chunk if n is None else max(1, min(chunk, n))  # rows of a buffer
        for start, ids, x, ok in self._batches(chunk, wanted):
            places = self._place(start, ids, ok, chunk, n, wanted, buffers)
            if places and x is not None:
                self._forward(x, len(ids), places, start)
            for block in dict.fromkeys(p.block for p in places):
                if block.full:
                    yield self._finished(block)
            advance(sum(p.count for p in places))
            if n is None:
                self.samples = start + len(ids)
        for block in list(self._open.values()):  # the end of a source of unknown length
            block.capacity = block.rows
            yield self._finished(block)

    def _batches(
        self, chunk: int, wanted: Callable[[int], bool]
    ) -> Iterator[tuple[int, list[str], Any, list[bool]]]:
        if isinstance(self.src, Batches):
            yield from self.src.stream()
            return
        n = len(self.src)
        self.samples = n
        for k in range(math.ceil(n / chunk)):
            if wanted(k):
                stop = min((k + 1) * chunk, n)
                for b in range(k * chunk, stop, self.batch_size):
                    yield (b, *self.src.batch(b, min(b + self.batch_size, stop)))

    def _place(
        self,
        start: int,
        ids: list[str],
        ok: list[bool],
        chunk: int,
        n: int | None,
        wanted: Callable[[int], bool],
        buffers: Callable[[], dict[str, Tensor]],
    ) -> list[_Place]:
        """Where each row of a batch goes (rows of blocks not wanted go nowhere)."""
        reasons = self.src.errors() if not all(ok) else {}
        places, i = [], 0
        while i < len(ids):
            k = (start + i) // chunk
            count = min(len(ids) - i, (k + 1) * chunk - start - i)
            if wanted(k):
                block = self._open.get(k)
                if block is None:
                    capacity = chunk if n is None else min(chunk, n - k * chunk)
                    block = self._open[k] = self._block(k, k * chunk, capacity, buffers())
                places.append(_Place(block, block.rows, i, count))
                for j in range(i, i + count):
                    if not ok[j]:
                        block.bad.append(block.rows)
                    block.ids.append(ids[j])
                    block.errors.append("" if ok[j] else reasons.get(ids[j], "unreadable"))
            i += count
        return places

    def _block(self, index: int, start: int, capacity: int, buffers: dict[str, Tensor]) -> Block:
        return Block(index, start, capacity, buffers)

    def _finished(self, block: Block) -> Block:
        del self._open[block.index]
        for name in self.names:  # every layer has rows, even where no sample could be read
            if name not in block.held:
                self._buffer(block, name)
        if self._pinned:
            block.event = torch.cuda.current_stream(self.device).record_event()
        return block

    def _buffer(self, block: Block, name: str) -> Tensor:
        buffer = block.buffers.get(name)
        if buffer is None:
            if name not in self.shapes:
                raise UsageError("no sample of the first batch could be read (see errors)")
            row, dtype = self.shapes[name]
            size = max(self._size, block.capacity)
            buffer = torch.empty((size, *row), dtype=dtype, pin_memory=self._pinned)
            block.buffers[name] = buffer
        return buffer

    # -- one forward ------------------------------------------------------------------------------
    def _forward(self, x: Any, n: int, places: list[_Place], start: int) -> None:
        x = map_tensors(lambda _, t: self._to_device(t), x)
        self._mask, self._places, self._span = keep_mask(x), places, (start, start + n)
        try:
            call_model(self.model, x)
        except StopForward as e:
            if e.owner is not self.tap:
                raise
        finally:
            self._places, self._mask = [], None
            held, self._held = self._held, []
        changed = {name for name, rows, version in held if _torch.version(rows) != version}
        if changed:  # changed in place after the hook: this batch again, those layers copied
            self._copied |= changed
            for p in places:
                p.block.held.clear()
            self._forward(x, n, places, start)
            return
        if missing := self.tap.missing():
            raise CaptureError(
                f"layer(s) {missing} did not run during the forward of samples {start}.."
                f"{start + n - 1}, so they have no features: check that the model's forward "
                "reaches them for these inputs"
            )

    def _to_device(self, t: Tensor) -> Tensor:
        if t.device == self.device:
            return t
        if self._pinned and t.device.type == "cpu":  # pinned: the copy does not wait
            return (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True)
        return t.to(self.device)

    def _deliver(self, name: str, output: Tensor) -> None:
        """A layer's output in a forward: its rows, copied into their blocks' buffers."""
        start, stop = self._span
        rows = self._rows(name, output, stop - start, self._mask)
        row = tuple(rows.shape[1:])
        known = self.shapes.setdefault(name, (row, rows.dtype))
        if known[0] != row:
            raise UsageError(
                f"layer {name!r} gives rows of shape {row} for samples {start}..{stop - 1} but "
                f"{known[0]} for earlier ones: per-sample shapes vary (e.g. padding to each "
                "batch's longest, images of several sizes), and a store holds one shape per "
                "layer. Pass reduce='token_mean' (or 'spatial_mean', or a function giving every "
                "sample one shape), or make inputs one size (a tokenizer's "
                "padding='max_length', a transform that resizes)"
            )
        if self._can_hold(name, rows):
            self._places[0].block.held[name] = rows
            self._held.append((name, rows, _torch.version(rows)))
            return
        for p in self._places:
            buffer = self._buffer(p.block, name)
            target = buffer[p.at : p.at + p.count]
            target.copy_(rows[p.src : p.src + p.count], non_blocking=self._pinned)

    def _can_hold(self, name: str, rows: Tensor) -> bool:
        """Whether a block may keep ``rows`` itself (see the module's docstring)."""
        if len(self._places) != 1 or name in self._copied or rows.device.type != "cpu":
            return False
        p = self._places[0]
        if p.at or p.src or p.count != len(rows) or p.count != p.block.capacity:
            return False
        if rows.is_inference():  # no version counter (under torch.inference_mode)
            return False
        if self._owned is None:
            self._owned = _storages(self.model)
        return rows.untyped_storage().data_ptr() not in self._owned


def floating_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter or buffer (None: it has none)."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def _storages(model: nn.Module) -> set[int]:
    """Storages the model keeps between forwards: parameters, buffers, tensor attributes."""
    found = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():
        found |= {
            v.untyped_storage().data_ptr() for v in vars(module).values() if isinstance(v, Tensor)
        }
    return found
