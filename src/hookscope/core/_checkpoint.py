"""Activation checkpointing: module calls recomputed in backward are the same calls again.

``torch.utils.checkpoint`` (and Hugging Face's ``gradient_checkpointing_enable``, built on
it) runs a segment's forward once, then again inside backward to rebuild what it did not
keep. Hooks fire both times. hookscope treats the second run as a replay of the first:

* non-reentrant (``use_reentrant=False``): backward runs through the graph of the first run,
  so gradients hooked then arrive; the replay only has to repeat value edits exactly;
* reentrant (``use_reentrant=True``): the first run is under ``no_grad`` and backward runs
  through the graph the replay builds, so gradient hooks (and gradient edits) go there.

To map a replayed call to its original, each session logs, per checkpoint segment, the calls
that ran inside it; a replay finds its segment on the Python stack (the checkpoint's own frames
hold the segment object: the Function ``ctx`` or the ``_CheckpointFrame``) and takes the
calls of each layer in order. Unknown checkpoint implementations degrade to "not found".
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Hashable
from types import CodeType, FrameType
from typing import Any

import torch

from ..errors import TorchCompatError
from . import _torch

__all__ = ["REENTRANT", "Replay", "find_segments", "maybe_in_segment"]

REENTRANT, NON_REENTRANT = "reentrant", "non-reentrant"

# code object -> (kind, is the recomputation, how to get the segment object from the frame)
_CODES: dict[CodeType, tuple[str, bool, Callable[[FrameType], Any]]] = {}


def _register() -> None:
    try:
        codes = _torch.checkpoint_codes()
    except TorchCompatError:  # replays are then not recognised (see need() for why)
        return
    ctx: Callable[[FrameType], Any] = lambda f: f.f_locals.get("ctx")  # noqa: E731

    def generator_frame(f: FrameType) -> Any:
        gen = f.f_locals.get("gen")
        return gen.gi_frame.f_locals.get("new_frame") if gen and gen.gi_frame else None

    _CODES[codes["reentrant_forward"]] = (REENTRANT, False, ctx)
    _CODES[codes["reentrant_backward"]] = (REENTRANT, True, ctx)
    _CODES[codes["non_reentrant"]] = (NON_REENTRANT, False, generator_frame)
    _CODES[codes["non_reentrant_unpack"]] = (NON_REENTRANT, True, lambda f: f.f_locals.get("frame"))


_register()


def maybe_in_segment() -> bool:
    """Cheap test: could a checkpoint segment's forward be running? (Reentrant segments run
    under no_grad; non-reentrant ones under saved-tensor hooks.)"""
    return not torch.is_grad_enabled() or _torch.saved_tensor_hooks_active()


def find_segments() -> tuple[Any, str | None, list[tuple[Any, str]]]:
    """``(replayed segment or None, its kind, [(segment, kind)] whose first run encloses
    this call)``.

    Walks the stack outwards; segments entered inside a replay are first runs of their own.
    """
    frame: FrameType | None = sys._getframe(1)
    first_runs: list[tuple[Any, str]] = []
    while frame is not None:
        entry = _CODES.get(frame.f_code)
        if entry is not None:
            kind, replay, key_of = entry
            key = key_of(frame)
            if key is not None:
                if replay:
                    return key, kind, first_runs
                first_runs.append((key, kind))
        frame = frame.f_back
    return None, None, first_runs


class Replay:
    """One session's log of calls made inside checkpoint segments, to map replays."""

    __slots__ = ("__weakref__", "_logs")

    def __init__(self) -> None:
        # id(segment) -> {"calls": {site: [items]}, "cursors": {(backward, site): next}}
        self._logs: dict[int, dict[str, dict[Any, Any]]] = {}

    def note(self, segments: list[Any], site: Hashable, item: Any) -> None:
        """Remember that ``item`` (a call) of ``site`` ran in each of these segments."""
        for segment in segments:
            log = self._logs.get(id(segment))
            if log is None:
                log = self._logs[id(segment)] = {"calls": {}, "cursors": {}}
                weakref.finalize(segment, _forget, weakref.ref(self), id(segment))
            log["calls"].setdefault(site, []).append(item)

    def find(self, segment: Any, site: Hashable, backward: int) -> Any:
        """The original of the next replayed call of ``site`` in ``segment`` (None: unknown)."""
        log = self._logs.get(id(segment))
        if log is None:
            return None
        items = log["calls"].get(site, [])
        cursor = (backward, site)
        i = log["cursors"].get(cursor, 0)
        if i >= len(items):
            return None
        log["cursors"][cursor] = i + 1
        return items[i]


def _forget(replay: weakref.ref[Replay], key: int) -> None:
    owner = replay()
    if owner is not None:
        owner._logs.pop(key, None)
