"""What a session knows about the calls running now, per thread.

Module hooks live in the module's hook dicts, which every thread calling the module shares:
a session open on a model sees the forwards of every thread. What a forward is doing (the
stack of running calls, their depth, the call counts of the pass, the pass itself) therefore
belongs to the thread that runs it: :class:`Now` holds it, one per thread and session, so
concurrent forwards from several threads are each their own pass, as if they had run one
after another. Private forwards (:func:`private_forward`) are private to their thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from .ops._select import OpSelector

__all__ = [
    "RUNNERS",
    "UNJUDGED",
    "ModuleCall",
    "Now",
    "PerThread",
    "hidden",
    "in_own_forward",
    "own_forward",
    "private_forward",
    "private_to",
]


class ModuleCall:
    """One call of a tracked module, or of an operation inside one (plain data, made by the
    session).

    Attributes:
        name: the module's canonical dotted name (``""`` for the model itself), or the
            operation site's (``"h.0.attn::softmax"``).
        module: the module (for an operation, the module whose own code runs it).
        index: how many calls of this module (or operation site) came before it in this pass
            (0 for the first).
        depth: how many tracked calls enclose it.
        parent: the innermost enclosing tracked call, or None.
        pass_index: the top-level forward it belongs to.
        replay: it is a checkpoint's recomputation inside backward.
        original: for a replay, the call it repeats, if known.
        op: for an operation's call, its selector (else None).
    """

    __slots__ = (
        "depth",
        "index",
        "module",
        "name",
        "op",
        "original",
        "parent",
        "pass_index",
        "replay",
    )

    def __init__(
        self, name: str, module: nn.Module, index: int, parent: ModuleCall | None, pass_: int
    ) -> None:
        self.name, self.module, self.index, self.parent = name, module, index, parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.pass_index = pass_
        self.replay = False
        self.original: ModuleCall | None = None
        self.op: OpSelector | None = None

    def __repr__(self) -> str:
        kind = ", replay" if self.replay else ""
        return f"ModuleCall({self.name!r}, index={self.index}, depth={self.depth}{kind})"


class Now:
    """One session's view of the forward running on one thread (see :class:`PerThread`): a
    plain object, so that a hook reads the thread-local once and then plain attributes."""

    def __init__(self) -> None:
        self.stack: list[ModuleCall] = []  # running tracked calls, innermost last
        self.counts: dict[str, int] = {}  # calls per module (or site) in this pass
        self.depth = 0  # nesting of root calls: a recursive root is still one pass
        self.pass_index = -1  # this thread's current (or latest) pass
        self.open: dict[Any, list[Any]] = {}  # per site: calls between pre- and post-hook
        self.extra: dict[str, Any] = {}  # a session's own per-pass state (see Session.now)
        self.last_done: str | None = None  # the last site that finished a call (for messages)
        #: this thread's private forwards (the list :func:`private_forward` pushes onto, empty
        #: almost always): a hot path tests it without a second thread-local read
        self.private = _PRIVATE.blocks
        #: inside a section of shared state this thread entered without the session's lock,
        #: as the session's only thread (see ``Session._join``)
        self.busy = False
        #: ``Session._ignores``' verdict, kept while ``private[-1]`` is ``judged`` (None: no
        #: private forward): whether this thread is one the session is for, and whether the
        #: private forward hides the session from it
        self.judged: object = UNJUDGED
        self.member = True
        self.hidden = False


class PerThread(threading.local):
    """A session's per-thread state: ``now``, made fresh on each thread's first read, which
    ``joined(now)`` is told of."""

    def __init__(self, joined: Callable[[Now], None] | None = None) -> None:
        self.now = Now()
        if joined is not None:
            joined(self.now)


class _Private(threading.local):
    def __init__(self) -> None:
        #: the private forwards running on this thread, outermost first: each the sessions
        #: that see it (the innermost decides: a replay inside hookscope's own forward is
        #: seen by the replay's session alone)
        self.blocks: list[tuple[object, ...]] = []


_PRIVATE = _Private()

#: ``Now.judged`` before ``Session._ignores`` has judged (never a private forward's block)
UNJUDGED = object()

#: Named in :func:`private_forward`: hookscope's own runners (sessions of entry points that run
#: the model themselves, ``this_thread=True``) see the forward; sessions of the user's code do
#: not. The forwards ``summary``, ``extract`` and ``report`` run are private so.
RUNNERS = object()


@contextlib.contextmanager
def private_forward(*sessions: object) -> Iterator[None]:
    """Forwards run inside, on this thread, are seen by ``sessions`` only: every other
    session ignores them (other threads' forwards are not affected). Nested, the innermost
    block decides."""
    blocks = _PRIVATE.blocks
    blocks.append(sessions)
    try:
        yield
    finally:
        blocks.pop()


def own_forward(*also: object) -> contextlib.AbstractContextManager[None]:
    """Forwards hookscope runs for itself (``summary``'s, ``extract``'s, the report's): seen by
    hookscope's runners, by sessions opened inside the block (the report's own ``Monitor``) and
    by those ``also`` names, never by the sessions of the user's code (an open ``capture`` or
    ``Monitor`` does not count them)."""
    return private_forward(RUNNERS, *also)


def in_own_forward() -> bool:
    """Whether the innermost private forward on this thread is hookscope's own (a session
    opened now is hookscope's, see :func:`own_forward`)."""
    blocks = _PRIVATE.blocks
    return bool(blocks) and RUNNERS in blocks[-1]


def hidden(session: object, runner: bool, blocks: list[tuple[object, ...]]) -> bool:
    """Whether a private forward that ``session`` must not see runs on this thread
    (``runner``: the session is one of hookscope's runners, see :data:`RUNNERS`; ``blocks``:
    this thread's private forwards, its ``Now.private``)."""
    if not blocks:
        return False
    seen_by = blocks[-1]
    return session not in seen_by and not (runner and RUNNERS in seen_by)


def private_to(session: object) -> bool:
    """Whether the innermost private forward on this thread names ``session``."""
    blocks = _PRIVATE.blocks
    return bool(blocks) and session in blocks[-1]
