"""Child processes for the tests that need several (gloo ranks, a child to SIGKILL), forked
from a server that has imported torch and hookscope once (multiprocessing's "forkserver").

A spawned child is a fresh interpreter that imports torch, hookscope and the test module
again: ~2 s of CPU each, most of a gloo test's time (the 4-rank HSDP tests start 4 at once).
What these tests check happens after the imports (the process group, the collectives, a kill
and a resume), so a child forked from an interpreter that already did them is the same child,
started in a fraction of the time. The server is started by the first test of a pytest
process that asks for it (each xdist worker has its own) and ends with that process.

The command-line tests start real interpreters (``python -m hookscope``): what they test is
the command, so they do not come here.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Imported once by the server, before it forks any child. Every user of the forkserver in a
#: test process must agree on this list: the server reads it when it starts, once.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.nn.parallel",
    "numpy",
    "pytest",
    "hookscope",
    "zarr",  # (the extract extra: a missing one is passed over)
]

#: What :func:`torch.multiprocessing.start_processes` takes as ``start_method``.
START_METHOD = "forkserver"


def context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server to preload :data:`PRELOAD` (call before starting any
    process; torch.multiprocessing's ``start_method="forkserver"`` uses the same server)."""
    ctx = multiprocessing.get_context(START_METHOD)
    assert isinstance(ctx, multiprocessing.context.ForkServerContext)
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class Child:
    """``fn(*args)`` in a process forked from the server, its stderr kept in ``stderr_file``
    (a Popen's ``stderr=PIPE``, for the messages of failed assertions). ``exitcode`` is
    ``-signal.SIGKILL`` for a child killed so, as a Popen's ``returncode`` is."""

    def __init__(self, fn: Callable[..., Any], *args: Any, stderr_file: Path) -> None:
        self.stderr_file = stderr_file
        self.process = context().Process(target=_run, args=(fn, args, str(stderr_file)))
        self.process.start()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status once the child ended, None if it still runs after ``timeout``."""
        self.process.join(timeout)
        return self.process.exitcode

    def kill(self) -> None:
        """SIGKILL, then wait for it to end."""
        self.process.kill()
        self.process.join()

    @property
    def stderr(self) -> str:
        return self.stderr_file.read_text() if self.stderr_file.is_file() else ""


def _run(fn: Callable[..., Any], args: tuple[Any, ...], stderr_file: str) -> None:
    """In the child: stderr (the file descriptor, so C code's writes too) into the file, then
    ``fn``. An exception is printed there by multiprocessing, and the exit status is 1."""
    import os
    import sys

    fd = os.open(stderr_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 (fd 2 outlives this function)
    fn(*args)


def killed_stores(
    tmp_path: Path,
    child: Callable[..., Child],
    points: list[list[int]],
    seeds: int,
    timer_s: tuple[float, float],
    delay: float,
    after_kill: Callable[[Path], None] = lambda out: None,
) -> list[tuple[Path, bool]]:
    """The stores SIGKILL left behind, for the extraction tests' resume checks: one per list
    of ``points`` (a child killed at each forward in turn, each after the first resuming the
    store; ``after_kill(store)`` runs after each kill) and one per seed (a child sleeping
    ``delay`` seconds after each forward, killed at a random moment in ``timer_s`` seconds,
    inside chunk writes too). ``child(out, kill_at=, delay=, resume=)`` starts a child; two
    run at a time. Each result is ``(store, resume)``: ``resume`` is False where the timer
    killed the child before it made the store, so the resume must start one."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    def killed_at(at: list[int]) -> tuple[Path, bool]:
        out = tmp_path / f"kill{'_'.join(map(str, at))}"
        for i, point in enumerate(at):
            started = child(out, kill_at=point, resume=i > 0)
            assert started.wait(timeout=120) == -signal.SIGKILL, started.stderr[-2000:]
            after_kill(out)
        return out, True

    def killed_by_timer(seed: int) -> tuple[Path, bool]:
        out = tmp_path / f"timer{seed}"
        started = child(out, kill_at=0, delay=delay)
        if started.wait(timeout=float(np.random.default_rng(seed).uniform(*timer_s))) is None:
            started.kill()
        return out, out.exists()

    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(killed_at, at) for at in points]
        runs += [pool.submit(killed_by_timer, seed) for seed in range(seeds)]
        return [run.result() for run in runs]
