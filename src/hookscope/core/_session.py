"""The one way hookscope hooks a model: a :class:`Session`.

Every entry point that hooks a model (``capture``, ``edit``, ``summary``, ``nonfinite``,
``Monitor``, the CAM methods, ``features`` and ``extract``) is a session, and so shares one
set of policies, decided here:

* **Layers** are resolved when the session is built, so a bad selector fails before any
  forward (``_naming``).
* **Refusals** when it opens: ``nn.DataParallel`` over several devices (its replicas run in
  threads); TorchScript modules, whose calls run in C++ where PyTorch calls no Python hook; a
  ``torch.compile``d model that already ran, whose cached code would ignore new hooks, unless
  ``recompile=True`` (compiled code then runs eagerly while the session is open, ``_compile``).
  Entry points that run the model themselves (``summary``, ``features``, ``extract``, the CAM
  methods, ``report``) pass ``recompile=True``: the forward is theirs.
* **Passes.** A forward pre-hook on the model's root starts a pass; a forward hook (always
  called) ends it, so a recursive root call stays one pass. A forward ended by a
  ``BaseException`` (an early stop, ``KeyboardInterrupt``) skips every end hook, so a root call
  that finds a pass still open checks the Python stack: if no call of the root is running, the
  old pass is over, the calls it left open are abandoned, and a new pass starts.
* **Calls** (:meth:`Session._track`): a pre-hook and an always-called post-hook per module
  keep the stack of running calls, each a :class:`ModuleCall` with its canonical name, its
  index among the module's calls in this pass, its depth and parent. A call that raised ends
  with :meth:`Session._raised`; one that returned with :meth:`Session._returned`.
* **Replays.** Activation checkpointing runs a segment's forward again inside backward. Those
  calls are replays of calls already seen: sessions that do not ask for them
  (``replays=True``) never see them; those that do get ``call.replay`` set and, where the
  checkpoint is recognised, ``call.original`` (``_checkpoint``).
* **Private forwards.** A forward hookscope runs on the user's model for its own purposes (the
  NaN tracer's replay) is seen only by the sessions it names (:func:`private_forward`).
* ``torch.func`` transforms: calls inside them are refused by the sessions that record values.

Nesting. ``with`` on a session that is already open nests: the hooks stay until the
outermost block exits. :meth:`close` closes at once.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from . import _torch
from ._checkpoint import Replay, find_segments, maybe_in_segment
from ._compile import compile_guard, is_compiled
from ._lifetime import HookSet
from ._naming import Layers, is_called

__all__ = ["ModuleCall", "Session", "private_forward", "replica_error", "scripted_error"]

#: While a private forward runs: a marker and the sessions that see it (else empty).
_PRIVATE: list[object] = []


@contextlib.contextmanager
def private_forward(*sessions: Session) -> Iterator[None]:
    """Forwards run inside are seen by ``sessions`` only: every other session ignores them."""
    added = [object(), *sessions]
    _PRIVATE.extend(added)
    try:
        yield
    finally:
        del _PRIVATE[len(_PRIVATE) - len(added) :]


def hidden(session: Session) -> bool:
    """Whether a private forward that ``session`` must not see is running."""
    return bool(_PRIVATE) and session not in _PRIVATE


class ModuleCall:
    """One call of a tracked module (plain data, made by the session).

    Attributes:
        name: the module's canonical dotted name (``""`` for the model itself).
        module: the module.
        index: how many calls of this module came before it in this pass (0 for the first).
        depth: how many tracked calls enclose it.
        parent: the innermost enclosing tracked call, or None.
        pass_index: the top-level forward it belongs to.
        replay: it is a checkpoint's recomputation inside backward.
        original: for a replay, the call it repeats, if known.
    """

    __slots__ = ("depth", "index", "module", "name", "original", "parent", "pass_index", "replay")

    def __init__(
        self, name: str, module: nn.Module, index: int, parent: ModuleCall | None, pass_: int
    ) -> None:
        self.name, self.module, self.index, self.parent = name, module, index, parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.pass_index = pass_
        self.replay = False
        self.original: ModuleCall | None = None

    def __repr__(self) -> str:
        kind = ", replay" if self.replay else ""
        return f"ModuleCall({self.name!r}, index={self.index}, depth={self.depth}{kind})"


class Session:
    """Base of every hookscope entry point that hooks a model (see the module docstring).

    A client subclasses it, registers its hooks in :meth:`_install` (usually
    ``self._track(hooks, modules)``, with ``modules`` from ``self.layers.select(...)`` or
    :meth:`every_module`) and reacts to calls in :meth:`_started`, :meth:`_returned` and
    :meth:`_raised`; :meth:`_new_pass` marks each top-level forward. Gradient hooks taken
    during a call go through ``self.hooks.tensor(t, fn)`` / ``self.hooks.node(node, fn)``, so
    that closing removes them too. Entry points that run the model themselves pass
    ``recompile=True`` and call it inside :func:`run_eagerly`.

    Example:
        >>> import torch, torch.nn as nn
        >>> from hookscope.core import Session
        >>> class Names(Session):
        ...     def _install(self, hooks):
        ...         self.seen = []
        ...         self._track(hooks, self.every_module())
        ...     def _returned(self, call, args, output):
        ...         self.seen.append((call.name, call.depth))
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with Names(net) as s:
        ...     _ = net(torch.ones(1, 2))
        >>> s.seen
        [('0', 1), ('1', 1), ('', 0)]
    """

    def __init__(self, model: nn.Module, *, recompile: bool = False) -> None:
        self.model = model
        self._layers = Layers(model)
        self._recompile = recompile
        self._hooks: HookSet | None = None
        self._exit = contextlib.ExitStack()
        self._entered = 0  # nesting of `with` blocks
        self._depth = 0  # nesting of root calls: a recursive root is still one pass
        self._pass = -1
        # call tracking (_track)
        self._stack: list[ModuleCall] = []
        self._counts: dict[str, int] = {}
        self._replays = False
        self._replay_log = Replay()

    @property
    def layers(self) -> Layers:
        """The model's selectable layers (names, aliases, the unwrapped root)."""
        return self._layers

    @property
    def is_open(self) -> bool:
        """Whether the session's hooks are installed (inside its ``with`` block, or between
        :meth:`open` and :meth:`close`)."""
        return self._hooks is not None

    @property
    def hooks(self) -> HookSet:
        """The hooks of the open session (tensor and node hooks are added here)."""
        if self._hooks is None:
            raise RuntimeError("the session is not open")
        return self._hooks

    # -- subclass API ---------------------------------------------------------------------------
    def _install(self, hooks: HookSet) -> None:
        """Register the session's hooks on its layers."""
        raise NotImplementedError

    def _new_pass(self) -> None:
        """Called when a top-level forward of the model starts."""

    def _closed(self) -> None:
        """Called once the hooks are gone."""

    def _needs_python(self) -> bool:
        """Whether the model's own Python code must run (operation selectors, ``_ops``): a
        compiled model then runs eagerly while open (``recompile=True``), or is refused."""
        return False

    def _started(self, call: ModuleCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A tracked call starts; may return ``(args, kwargs)`` to replace its inputs."""
        return None

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> Any:
        """A tracked call returned; may return a replacement output."""
        return None

    def _raised(self, call: ModuleCall) -> None:
        """A tracked call ended with an exception (or was abandoned by one)."""

    # -- lifecycle --------------------------------------------------------------------------------
    def open(self) -> Any:
        """Install the hooks (``with`` does this); pair with :meth:`close`."""
        if self._hooks is not None:
            return self
        _check_model(self.model, self._layers.root)
        compiled = is_compiled(self.model)
        with contextlib.ExitStack() as stack:
            if compiled:
                python = self._needs_python()
                stack.enter_context(
                    compile_guard(self.model, recompile=self._recompile, python=python)
                )
            self._hooks = hooks = HookSet(eager=compiled)
            stack.callback(hooks.close)
            hooks.forward_pre(self._layers.root, self._on_root_start)
            hooks.forward(self._layers.root, self._on_root_end, always_call=True)
            self._install(hooks)
            self._exit = stack.pop_all()
        return self

    def close(self) -> None:
        """Remove every hook this session added. Idempotent; results stay readable."""
        try:
            self._exit.close()
        finally:
            self._hooks = None
            self._depth = 0
            self._entered = 0
            self._stack.clear()
            self._closed()

    def __enter__(self) -> Any:
        opened = self.open()
        self._entered += 1
        return opened

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._entered -= 1
        if self._entered <= 0:
            self.close()
        return None

    # -- passes ------------------------------------------------------------------------------------
    def _on_root_start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._in_backward() or hidden(self):  # a replay, or a private forward
            return
        if module is not self._layers.root:
            raise replica_error(module)
        if self._depth and not _running(module, skip=1):
            self._depth = 0  # that forward was ended by a BaseException: a new pass
        self._depth += 1
        if self._depth == 1:
            self._abandon()
            self._pass += 1
            self._counts.clear()
            self._new_pass()

    def _on_root_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._in_backward() and not hidden(self):
            self._depth = max(0, self._depth - 1)

    def _in_backward(self) -> bool:
        """A forward running inside backward: a checkpoint's replay (a private forward run
        from a backward callback is a forward of its own for the sessions it is for)."""
        return _torch.backward_id() != -1 and not (_PRIVATE and self in _PRIVATE)

    # -- calls -------------------------------------------------------------------------------------
    def _check_hookable(self, names: Mapping[str, Any]) -> None:
        """Refuse layers inside TorchScript, where Python hooks never run."""
        for name in names:
            if self._layers.in_script(name):
                raise scripted_error(repr(name), self._layers.modules[name])

    def every_module(self) -> dict[str, nn.Module]:
        """``{name: module}`` of every module that can be called, the root as ``""`` first;
        TorchScript modules are opaque (their insides run in C++, unhooked)."""
        found = {"": self._layers.root}
        for name, module in self._layers.modules.items():
            if is_called(module) and not self._layers.in_script(name):
                found[name] = module
        return found

    def _track(
        self,
        hooks: HookSet,
        modules: Mapping[str, nn.Module],
        *,
        replays: bool = False,
    ) -> None:
        """Follow every call of ``modules`` (see the module docstring); ``replays``: also the
        recomputations activation checkpointing runs in backward."""
        self._replays = replays
        self._check_hookable({n: m for n, m in modules.items() if n})
        for name, module in modules.items():
            hooks.forward_pre(module, functools.partial(self._call_pre, name), with_kwargs=True)
            hooks.forward(module, functools.partial(self._call_post, name), always_call=True)

    def _track_outputs(self, hooks: HookSet, modules: Mapping[str, nn.Module]) -> None:
        """Follow only the outputs of ``modules`` (one forward hook each, no call stack):
        :meth:`_output` gets each returned output, replays and private forwards excluded."""
        self._check_hookable({n: m for n, m in modules.items() if n})
        for name, module in modules.items():
            hooks.forward(module, functools.partial(self._output_hook, name))

    def _output(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """A module followed by :meth:`_track_outputs` returned; may return a new output."""
        return None

    def _output_hook(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if (_PRIVATE and self not in _PRIVATE) or self._in_backward():
            return None
        if name and module is not self._layers.modules.get(name):
            raise replica_error(module)
        return self._output(name, module, args, output)

    def _call_pre(
        self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if _PRIVATE and self not in _PRIVATE:
            return None
        replay = self._in_backward()
        if replay and not self._replays:
            return None
        if name and module is not self._layers.modules.get(name):
            raise replica_error(module)
        index = self._counts.get(name, 0)
        call = ModuleCall(name, module, index, self._stack[-1] if self._stack else None, self._pass)
        if replay:
            call.replay = True
            call.index = -1
            segment, _, first_runs = find_segments()
            call.original = self._replay_log.find(segment, name, _torch.backward_id())
            if call.original is not None:
                call.index = call.original.index
                self._replay_log.note([k for k, _ in first_runs], name, call.original)
        else:
            self._counts[name] = index + 1
            if self._replays and maybe_in_segment():
                _, _, first_runs = find_segments()
                self._replay_log.note([k for k, _ in first_runs], name, call)
        self._stack.append(call)
        return self._started(call, args, kwargs)

    def _call_post(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if _PRIVATE and self not in _PRIVATE:
            return None
        if not self._replays and self._in_backward():
            return None
        stack = self._stack
        while stack and stack[-1].module is not module:  # left open by a BaseException
            self._raised(stack.pop())
        if not stack:
            return None  # its start was not seen (the session opened during the call)
        call = stack.pop()
        if _torch.call_raised():
            self._raised(call)
            return None
        return self._returned(call, args, output)

    def _abandon(self) -> None:
        """Calls a BaseException left open: they ended without returning."""
        while self._stack:
            self._raised(self._stack.pop())


def _running(module: nn.Module, skip: int) -> bool:
    """Whether a call of ``module`` is on the Python stack (beyond the innermost ``skip``)."""
    frame = sys._getframe(1)
    codes = _torch.CALL_CODES
    while frame is not None:
        if frame.f_code in codes and frame.f_locals.get("self") is module:
            if skip == 0:
                return True
            skip -= 1
            # _wrapped_call_impl calls _call_impl: both frames belong to the same call
            if frame.f_back is not None and frame.f_back.f_code in codes:
                frame = frame.f_back
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _check_model(model: nn.Module, root: nn.Module) -> None:
    """Refuse models whose calls cannot be followed: TorchScript, DataParallel replicas."""
    if isinstance(root, torch.jit.ScriptModule):
        raise scripted_error("the model", root)
    module: nn.Module | None = model
    while module is not None:
        if isinstance(module, nn.DataParallel) and len(module.device_ids or []) > 1:
            raise UnsupportedModelError(
                f"nn.DataParallel over {len(module.device_ids)} devices runs a copy of the "
                "model per device, in threads; hookscope cannot attribute their calls "
                "reliably. Hook the model on one device (model.module, or DataParallel with "
                "device_ids=[0]), or use DistributedDataParallel (one process per GPU)."
            )
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        module = inner if isinstance(inner, nn.Module) else None


def replica_error(module: nn.Module) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"a hook of hookscope ran on a copy of the hooked {type(module).__name__} (a "
        "DataParallel replica, or a copy made while the hooks existed); hookscope records "
        "only the modules it hooked. Hook the model on one device."
    )


def scripted_error(what: str, module: nn.Module) -> UnsupportedModelError:
    kind = getattr(module, "original_name", type(module).__name__)
    return UnsupportedModelError(
        f"{what} ({kind}) is TorchScript (torch.jit.script / trace) or part of a TorchScript "
        "module: PyTorch runs it in C++ and does not allow Python hooks on it or inside it. "
        "Hook the Python model before scripting it (or export it with torch.export instead)."
    )
