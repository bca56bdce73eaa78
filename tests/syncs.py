"""Counting CUDA host synchronisations in a test (shared by the CUDA tests)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def syncs() -> Iterator[list[str]]:
    """The synchronising calls made inside the block, one message each."""
    seen: list[str] = []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen += [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
