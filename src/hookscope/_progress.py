"""Progress bars for long runs (perturbation methods, extraction, the demo's training).

``progress=None`` (every public default) shows a bar only when standard error is a terminal and
no CI is detected; ``True`` forces one, ``False`` never shows one. The bar is drawn by rich when
it is installed, else by tqdm, else as a plain line rewritten in place: no extra is required.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from .errors import UsageError

__all__ = ["Advance", "progress", "wanted"]


class Advance(Protocol):
    def __call__(self, n: int = 1) -> None: ...


def wanted(setting: bool | None) -> bool:
    """Whether to draw a bar for ``progress=setting``."""
    if setting is not None and not isinstance(setting, bool):
        raise UsageError(f"progress must be True, False or None (automatic), got {setting!r}")
    if setting is not None:
        return setting
    return sys.stderr.isatty() and not os.environ.get("CI")


@contextmanager
def progress(total: int | None, description: str, setting: bool | None) -> Iterator[Advance]:
    """Yield ``advance(n=1)``; a bar with count, rate and time left is drawn if ``setting``
    asks for one (see the module's docstring)."""
    if not wanted(setting):
        yield _nothing
        return
    if importlib.util.find_spec("rich") is not None:
        with _rich(total, description) as advance:
            yield advance
    elif importlib.util.find_spec("tqdm") is not None:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]

        with tqdm(total=total, desc=description, file=sys.stderr, leave=False) as bar:
            yield bar.update
    else:
        with _plain(total, description) as advance:
            yield advance


def _nothing(n: int = 1) -> None:
    return None


@contextmanager
def _rich(total: int | None, description: str) -> Iterator[Advance]:
    from rich import progress as rp

    columns: list[Any] = [
        rp.TextColumn("{task.description}"),
        rp.BarColumn(),
        rp.MofNCompleteColumn(),
        rp.TaskProgressColumn(show_speed=True),
        rp.TimeRemainingColumn(),
    ]
    with rp.Progress(*columns, transient=True, console=_console()) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


def _console() -> Any:
    from rich.console import Console

    return Console(file=sys.stderr, force_terminal=True)  # reached only when a bar is wanted


@contextmanager
def _plain(total: int | None, description: str) -> Iterator[Advance]:
    start, done = time.perf_counter(), 0

    def advance(n: int = 1) -> None:
        nonlocal done
        done += n
        rate = done / max(time.perf_counter() - start, 1e-9)
        left = f", {(total - done) / rate:.0f} s left" if total and rate > 0 else ""
        of = f"/{total}" if total else ""
        sys.stderr.write(f"\r{description}: {done}{of} ({rate:.1f}/s{left})   ")
        sys.stderr.flush()

    try:
        yield advance
    finally:
        sys.stderr.write("\n")
