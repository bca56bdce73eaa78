"""``edit``: temporarily change what flows through selected layers.

Value edits replace the layer's inputs (pre-hook) or outputs (forward hook), keeping the
output's structure. Gradient edits hook the autograd graph:

* ``on="grad"`` rewrites, with a tensor hook on the output itself, the gradient coming back
  from downstream; a stand-in copy is used only where the graph cannot separate it (see
  ``_autograd``);
* ``on="input_grad"`` must see the sum of everything the layer sends back to an input before
  it meets other uses of that input, so the layer gets a stand-in copy of the input (same
  strides and values) whose gradient hook applies the edit. If the layer changes that input
  in place, the change is copied back to the caller's tensor, and a returned stand-in is
  swapped back for the original, so the model computes exactly what it would without the
  stand-in;
* ``param_grad`` (``clip_grad``) hooks the layer's parameters.

Under activation checkpointing a replayed call gets the same edits with the same call index
(see ``_checkpoint``).

An operation site (``"layer::op"``, ``ops/``) is edited by the same hooks, :meth:`Editor._pre`
and :meth:`Editor._post`, called by :meth:`Editor._run_op` around the intercepted call; edits
of an ``attention_weights`` site run its SDPA call explicitly (``ops/_attention``). Each
thread's forward counts its own calls (``_calls``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import EditError, UsageError
from . import _torch, _tree
from ._autograd import Boundary, backward_id, recomputing, stand_in, why_no_grad
from ._bind import Binder
from ._calls import ModuleCall
from ._checkpoint import REENTRANT, Replay, find_segments, maybe_in_segment
from ._edit import Edit, EditContext, call_checked, paths, transform
from ._lifetime import HookSet
from ._refusals import replica_error
from ._session import Run, Session
from ._steps import Steps, steps_of
from ._units import Indices, MaskNote, Narrow, Positions, Units, narrows
from .ops._attention import WAITING, chain_of, explicit
from .ops._select import SDPA, WEIGHTS, OpSelector, forward_op, op_binder, op_name

__all__ = ["Editor", "edit"]

_VALUE, _GRAD = ("output", "input"), ("grad", "input_grad")


class _Layer:
    """One edited layer (or operation: ``op``, see ``_ops``): its edits split by where they
    apply, and per-call state."""

    __slots__ = ("binder", "module", "name", "on_in", "on_out", "op", "params", "pre")

    def __init__(
        self, name: str, module: nn.Module, edits: list[Edit], op: OpSelector | None = None
    ) -> None:
        self.name, self.module, self.op = name, module, op
        self.on_in = [e for e in edits if e.on in ("input", "input_grad")]
        self.on_out = [e for e in edits if e.on in ("output", "grad")]
        self.params = [e for e in edits if e.on == "param_grad"]
        # A pre-hook is needed for input edits, and to mark where the call starts for
        # output-gradient edits (which outputs existed before the call).
        self.pre = bool(self.on_in) or any(e.on == "grad" for e in self.on_out)
        # an operation's binder depends on the function called: given per call (_run_op)
        self.binder = Binder(module) if self.pre and op is None else None


#: a call between pre-hook and forward hook (per thread, ``Session.now.open``): its index,
#: whether gradient edits can apply, its boundary, and the input stand-ins to mirror back as
#: (original, stand-in, version)
_Open = tuple[int, bool, Boundary | None, list[tuple[Tensor, Tensor, int]]]
_NO_ARGUMENTS = Binder(lambda: None)  # an attention-weights site's own call takes nothing


class Editor(Session):
    """Temporarily edit layers' outputs, inputs or gradients.

    ``hs.edit`` is this class, as ``hs.capture`` is :class:`Capture`.

    Args:
        model: the model (wrappers are seen through).
        edits: ``{selector: edit}`` (layer selectors, or operation selectors such as
            ``"h.3.attn::softmax"`` and ``"h.3.attn::attention_weights"``, see the README's
            "Inside the forward"); an edit is an :class:`Edit` (``hookscope.ablate()``,
            ``scale(k)``, ``add(v)``, ``replace(v)``, ``mean_ablate()``, ``patch(cap)``,
            ``transform(fn)``, ``clip_grad(...)``), a plain function tensor -> tensor (applied
            to the output), or a list of them (applied in order).
        recompile: see :class:`Capture`.
        positions: change only these token positions of each edited output: an index or a
            list of them (negative from the end), or ``"last"``, each sample's last real
            token (from the forward's ``attention_mask``); see :class:`Capture`.
        heads: change only these attention heads (of an SDPA call's output, of attention
            weights, of query, key and value projections).
        neurons: change only these indices of the output's last dimension.
        layout: where units lie in sites hookscope has no layout for; see :class:`Capture`.
        this_thread: edit only the forwards of the threads inside the ``with`` block (or
            between :meth:`open` and :meth:`close`): another thread's forward of the model
            meanwhile runs unedited. Off: every thread's forwards are edited.
        steps: edit only these forwards of the model (an int, a list of them or a range),
            counted from 0 since the editor was built: under ``generate()``, step 0 is the
            prefill and step ``t`` the forward that makes new token ``t`` (see
            :class:`Capture`). Gradient edits apply to the gradients of those forwards;
            parameter-gradient edits (``clip_grad``) are refused with it.

    With ``positions=``, ``heads=`` or ``neurons=``, an output edit sees the selected units
    only, in the shape a capture with the same units records (``hs.patch`` of such a capture
    fits), and its result replaces them; every other unit is left as it was. Edits of inputs
    and gradients are refused with units.

    A context manager: edits apply only inside the ``with`` block (gradient edits only to
    backward passes run inside it), to the forwards of every thread (``this_thread=False``).

    Attributes:
        applied: how many times edits were applied per layer (forward edits when they run,
            gradient edits as gradients arrive).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> with hs.edit(model, {"1": hs.ablate()}):
        ...     out = model(torch.ones(2, 3))
        >>> torch.equal(out, model[2].bias.expand(2, 1))
        True
    """

    #: edits are part of the function a torch.func transform computes, as a forward hook of
    #: the user's would be: inside vmap they see one sample's tensors, as the model does
    _transformable = True

    def __init__(
        self,
        model: nn.Module,
        edits: Mapping[Any, Edit | Callable[[Tensor], Tensor] | Sequence[Edit]],
        *,
        recompile: bool = False,
        positions: Positions | None = None,
        heads: Indices | None = None,
        neurons: Indices | None = None,
        layout: Mapping[str, str] | None = None,
        this_thread: bool = False,
        steps: Steps | None = None,
    ) -> None:
        if not isinstance(edits, Mapping):
            raise UsageError(
                "edits must be a dict {layer selector: edit}, e.g. {'layer1': hs.ablate()}, "
                f"not {type(edits).__name__}"
            )
        units = Units.of(positions, heads, neurons)
        self._steps = steps_of(steps)
        super().__init__(model, recompile=recompile, this_thread=this_thread)
        self._entry = "hs.edit"
        plan: dict[str, list[Edit]] = {}
        where: dict[str, tuple[nn.Module, OpSelector | None]] = {}
        for selector, value in edits.items():
            for name, site in self._layers.sites(selector).items():
                plan.setdefault(name, []).extend(_as_edits(value))
                where[name] = (site.module, site.op)
        self._masks = MaskNote() if units is not None and units.needs_mask else None
        resolve = self._layers.sites
        chosen = narrows(units, where, layout, resolve, self._masks, self._layers.root)
        for name, narrow in chosen.items():
            plan[name] = [_narrowed(edit, narrow) for edit in plan[name]]
        self._plan = {n: _Layer(n, where[n][0], e, where[n][1]) for n, e in plan.items()}
        self._site_objects = self._plan
        for layer in self._plan.values():
            if layer.op is not None:
                _check_op_edits(layer.op, layer.on_in + layer.on_out + layer.params)
            if layer.params and self._steps is not None:
                raise UsageError(
                    f"edit {layer.params[0].name!r} on {layer.name!r} changes parameter "
                    "gradients, which sum every forward's: steps= cannot limit it; edit the "
                    "output gradient (on='grad') of the steps instead, or leave steps= out"
                )
        self.applied: dict[str, int] = dict.fromkeys(self._plan, 0)
        self._counting = threading.Lock()  # `applied` counts calls from every thread
        self._replay = Replay()
        self._unknown: dict[tuple[str, int], int] = {}  # replays of unknown checkpoints
        self._watch_ops(self._plan, replays=True)  # edits apply to checkpoint replays too

    def open(self) -> Editor:
        """Install the edits (``with`` does this); pair with :meth:`close`."""
        opened: Editor = super().open()
        return opened

    def __enter__(self) -> Editor:
        opened: Editor = super().__enter__()
        return opened

    def _new_pass(self) -> None:
        self._now.open.clear()  # calls an interrupted forward of this thread left open

    def _install(self, hooks: HookSet) -> None:
        if self._steps is not None and self.latest_pass >= 0:
            raise UsageError(
                f"steps= counts the model's forwards since the editor was built, and this one "
                f"already saw {self.latest_pass + 1}: build a new hs.edit(...) for each "
                "generate() call"
            )
        self._check_hookable(self._plan)
        if self._masks is not None:  # positions="last": the forward's attention_mask
            self._root_binder = Binder(self._layers.root)
            hooks.forward_pre(self._layers.root, self._on_model_inputs, with_kwargs=True)
            hooks.forward(self._layers.root, self._on_model_end, always_call=True)
        for layer in self._plan.values():
            if layer.op is not None:
                continue  # an operation: its module's calls are followed by self._ops
            if layer.pre:
                pre = functools.partial(self._pre, layer)
                hooks.forward_pre(layer.module, pre, with_kwargs=True)
            if layer.on_out or layer.pre:
                hooks.forward(layer.module, functools.partial(self._post, layer))
            for edit in layer.params:
                for pname, param in layer.module.named_parameters():
                    if param.requires_grad:
                        ctx = EditContext(layer.name, 0, (pname,))
                        hooks.tensor(param, functools.partial(self._grad, edit, ctx))

    def _on_model_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        """``positions="last"``: note the forward's token mask (this thread's)."""
        if kwargs is None:  # a forward that took the hooks as this session removed it (_lifetime)
            return
        if self._masks is not None and self._now.depth == 1 and not self._ignores():
            self._masks.note(self._root_binder.bind(args, kwargs))

    def _on_model_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._masks is not None and not self._now.depth and not self._ignores():
            self._masks.note({})  # a layer called outside a forward has no mask

    def _rebound(self, layer: _Layer) -> None:
        if layer.op is None and layer.binder is not None:
            layer.binder = Binder(layer.module)

    def _skips(self, name: str, module: nn.Module) -> bool:
        """``steps=``: whether this call's forward is not one of the steps; a layer called
        by itself, outside a forward of the model, has no step and is refused. A
        checkpoint's replay in backward gets the edits of the call it replays."""
        now = self._now
        if recomputing():
            return False
        if not now.depth and module is not self._layers.root:
            raise UsageError(
                f"steps= edits some forwards of the model, and {name!r} ran outside any "
                "(called by itself), so it has no step: call the model, or edit without steps="
            )
        assert self._steps is not None
        return now.pass_index not in self._steps

    def _step(self) -> int | None:
        """The step of the forward running (None outside one): for ``hs.patch``."""
        now = self._now
        return now.pass_index if now.depth else None

    # -- call indices ---------------------------------------------------------------------------
    def _index(self, layer: _Layer) -> tuple[int, bool]:
        """This call's index in the pass, and whether gradient edits can apply to it. A
        checkpoint's replay gets the index of the call it replays."""
        if recomputing():
            segment, kind, first_runs = find_segments()
            index = self._replay.find(segment, layer.name, backward_id())
            if index is None:  # an unknown replay: count replays of this layer instead
                key = (layer.name, backward_id())
                index = self._unknown.get(key, 0)
                self._unknown[key] = index + 1
            self._replay.note([k for k, _ in first_runs], layer.name, index)
            return index, kind == REENTRANT and torch.is_grad_enabled()
        calls: dict[str, int] = self._now.extra.setdefault("calls", {})  # this pass's
        index = calls.get(layer.name, 0)
        calls[layer.name] = index + 1
        grads = torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        if maybe_in_segment():
            _, _, first_runs = find_segments()
            self._replay.note([k for k, _ in first_runs], layer.name, index)
            if not grads and any(kind == REENTRANT for _, kind in first_runs):
                return index, False  # gradients come with the replay in backward
        if not grads and any(e.on in _GRAD for e in layer.on_in + layer.on_out):
            raise EditError(
                f"cannot edit the gradient of {layer.name!r}: there is none, because "
                f"{why_no_grad()}"
            )
        return index, grads

    # -- hooks --------------------------------------------------------------------------------
    def _pre(
        self,
        layer: _Layer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        binder: Binder | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if kwargs is None:  # a forward that took the hooks as this session removed it (_lifetime)
            return None
        if module is not layer.module:
            raise replica_error(module)
        if self._ignores() or (self._steps is not None and self._skips(layer.name, module)):
            return None
        index, grads = self._index(layer)
        binder = binder or layer.binder
        assert binder is not None
        bound = binder.bind(args, kwargs)
        new: Any = bound
        mirror: list[tuple[Tensor, Tensor, int]] = []
        for edit in layer.on_in:
            if edit.on == "input":
                new = self._apply(edit, new, layer.name, index, first_input=True)
            elif grads:
                new = self._stand_in_inputs(edit, new, layer.name, index, mirror)
        boundary = Boundary({}) if grads and any(e.on == "grad" for e in layer.on_out) else None
        self._now.open.setdefault(layer, []).append((index, grads, boundary, mirror))
        return None if new is bound else binder.unbind(args, kwargs, new)

    def _post(self, layer: _Layer, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if module is not layer.module:
            raise replica_error(module)
        if self._ignores() or (self._steps is not None and self._skips(layer.name, module)):
            return None
        opens: list[_Open] | None = self._now.open.get(layer)
        if opens:
            index, grads, boundary, mirror = opens.pop()
        else:
            (index, grads), boundary, mirror = self._index(layer), None, []
        new = _mirror_back(output, mirror) if mirror else output
        for edit in layer.on_out:
            if edit.on == "output":
                new = self._apply(edit, new, layer.name, index, first_input=False)
            elif grads and boundary is not None:
                new = self._edit_output_grad(edit, new, layer.name, index, boundary)
        return None if new is output else new

    def _apply(self, edit: Edit, tree: Any, name: str, index: int, first_input: bool) -> Any:
        for path in paths(edit, tree, name, first_input):
            old = _tensor_at(edit, tree, name, path)
            ctx = EditContext(name, index, path, self._step())
            where = f"edit {edit.name!r} on {name!r} {edit.on}{_tree.path_str(path)}"
            new = call_checked(
                _with_context(edit, ctx),
                old,
                where,
                grad=False,
                allow_shape_change=edit.allow_shape_change,
            )
            if not recomputing():
                self._count(name)
            tree = _tree.replace_at(tree, path, new)
        return tree

    def _count(self, name: str) -> None:
        with self._counting:
            self.applied[name] += 1

    def _edit_output_grad(
        self, edit: Edit, output: Any, name: str, index: int, boundary: Boundary
    ) -> Any:
        output, hook_on, _ = boundary.finish(output, inputs=False, separate=True)
        targets = set(paths(edit, output, name, first_input=False))
        for path, t in hook_on:
            if path in targets:
                self._hook(t, edit, EditContext(name, index, path, self._step()))
        for path in targets - {p for p, _ in hook_on}:
            _needs_grad(_tensor_at(edit, output, name, path), edit, name, path)
        return output

    def _stand_in_inputs(
        self, edit: Edit, bound: Any, name: str, index: int, mirror: list[Any]
    ) -> Any:
        chosen = paths(edit, bound, name, first_input=True)
        made: dict[int, Tensor] = {}  # one stand-in per tensor: `query is key` stays true
        for path in chosen:
            x = _tensor_at(edit, bound, name, path)
            _needs_grad(x, edit, name, path)
            _all_names_of(x, bound, set(chosen), edit, name)
            s = made.get(id(x))
            if s is None:
                s = made[id(x)] = stand_in(x)
                mirror.append((x, s, _torch.version(s)))
                self._hook(s, edit, EditContext(name, index, path, self._step()))
            bound = _tree.replace_at(bound, path, s)
        return bound

    def _hook(self, t: Tensor, edit: Edit, ctx: EditContext) -> None:
        self.hooks.tensor(t, functools.partial(self._grad, edit, ctx))

    def _grad(self, edit: Edit, ctx: EditContext, grad: Tensor) -> Tensor:
        self._count(ctx.layer)
        where = f"edit {edit.name!r} on {ctx.layer!r} {edit.on}{_tree.path_str(ctx.path)}"
        new = call_checked(_with_context(edit, ctx), grad, where, grad=True)
        assert new is not None
        return new

    # -- operation sites (see ``ops/``) ------------------------------------------------------
    def _run_op(
        self,
        owner: ModuleCall,
        layers: list[Any],
        weights: list[Any],
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Apply each of ``layers``' edits to an operation call (the first selector
        outermost) and, for an SDPA call whose ``weights`` are edited, run it explicitly with
        those edits."""
        named = (layers or weights)[0].name
        if self._steps is not None and self._skips(named, owner.module):
            return forward_op(func, args, kwargs)
        if weights:
            func = self._edited_sdpa(weights, func)
        run: Run = functools.partial(forward_op, func)
        for layer in reversed(layers):
            run = functools.partial(self._edit_value, layer, func, run)
        return run(args, kwargs)

    def _edit_value(
        self, layer: _Layer, func: Any, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        binder = op_binder(func)
        changed = _changed_in_place(func, binder, args, kwargs)
        if changed is not None:
            return self._edit_in_place(layer, changed, run, args, kwargs)
        if layer.pre:
            new = self._pre(layer, layer.module, args, kwargs, binder)
            if new is not None:
                args, kwargs = new
        out = run(args, kwargs)
        new_out = self._post(layer, layer.module, args, out)
        return out if new_out is None else new_out

    def _edit_in_place(
        self, layer: _Layer, changed: Tensor, run: Run, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        """An in-place operation's result is the tensor it changed, which the code goes on
        using (``y.add_(1)`` discards the return value): an output edit is written into that
        tensor, so the edit is what the code sees. Input and gradient edits have no tensor of
        their own there and are refused."""
        other = [e for e in layer.on_in + layer.on_out if e.on != "output"]
        if other:
            raise EditError(
                f"edit {other[0].name!r} ({other[0].on}) on {layer.name!r}: an in-place "
                "operation changes its input and returns it, so it has no input or gradient "
                "of its own to edit; edit its output (on='output'), or the layer's"
            )
        out = run(args, kwargs)
        new = self._post(layer, layer.module, args, out)
        if new is None or new is out:
            return out
        if out is not changed or not isinstance(new, Tensor) or new.shape != out.shape:
            raise EditError(
                f"edit on {layer.name!r}: an in-place operation's result is the tensor it "
                f"changed ({tuple(changed.shape)}), so the edit must return a tensor of that "
                f"shape, written back into it; got {_tree.describe(new)}"
            )
        return out.copy_(new)

    def _edited_sdpa(self, weights: list[_Layer], func: Any) -> Callable[..., Tensor]:
        """The SDPA call made explicit, with the edits of ``weights`` applied to its
        probabilities before those of sessions opened later (already in ``func`` if it is
        explicit)."""
        waiting = list(WAITING)  # the captures above this edit see its result
        own = [(functools.partial(self._edit_weights, layer), waiting) for layer in weights]
        return explicit([*own, *chain_of(func)], weights[0].module)

    def _edit_weights(self, layer: _Layer, probs: Tensor) -> Tensor:
        if layer.pre:  # gradient edits: mark where the call starts
            self._pre(layer, layer.module, (), {}, _NO_ARGUMENTS)
        new = self._post(layer, layer.module, (), probs)
        return probs if new is None else new


def _changed_in_place(
    func: Any, binder: Binder, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor | None:
    """The tensor an in-place call changes (``x.add_(y)``, ``torch.relu_(x)``,
    ``F.relu(x, inplace=True)``, ``x += y``), or None for an out-of-place call."""
    name = op_name(func)
    inplace = name.endswith("_") and not name.startswith("_")
    if not inplace and "inplace" in kwargs:
        inplace = bool(kwargs["inplace"])
    elif not inplace and len(args) > 1 and "inplace" in (binder.parameters() or ()):
        inplace = bool(binder.bind(args, kwargs).get("inplace", False))
    first = args[0] if args else None
    return first if inplace and isinstance(first, Tensor) else None


def _check_op_edits(op: OpSelector, edits: list[Edit]) -> None:
    """Refuse edits an operation cannot take, before anything is hooked."""
    for edit in edits:
        if edit.on == "param_grad":
            raise UsageError(
                f"{edit.name} applies to a layer's parameter gradients; the operation "
                f"{op.name!r} has no parameters: give it the layer ({op.module!r})"
            )
        if op.op == WEIGHTS and edit.on in ("input", "input_grad"):
            raise EditError(
                f"edit {edit.name!r} on {op.name!r}: attention weights have no inputs of their "
                f"own; edit the SDPA call's inputs with "
                f"'{op.module}::{SDPA}{f'#{op.k}' if op.k else ''}' instead"
            )


def _narrowed(edit: Edit, narrow: Narrow) -> Edit:
    """``edit`` applied to the units ``narrow`` selects, written back into the full tensor."""
    if edit.on != "output" or edit.allow_shape_change:
        what = "changes the shape" if edit.allow_shape_change else f"applies to the {edit.on}"
        raise UsageError(
            f"edit {edit.name!r} on {narrow.site!r} {what}; positions=, heads= and neurons= "
            "narrow edits of outputs of unchanged shape only: edit the whole tensor instead "
            "(with hs.transform, indexing it yourself)"
        )
    inner = edit.fn

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        part = narrow.take(t)
        new = inner(part, ctx)
        if not isinstance(new, Tensor) or new.shape != part.shape:
            got = tuple(new.shape) if isinstance(new, Tensor) else type(new).__name__
            raise EditError(
                f"edit {edit.name!r} on {narrow.site!r} got the selected units "
                f"{tuple(part.shape)} and returned {got}; return a tensor of their shape"
            )
        return narrow.put(t, new)

    return Edit(fn, on=edit.on, at=edit.at, name=edit.name)


def _with_context(edit: Edit, ctx: EditContext) -> Callable[[Tensor], Tensor]:
    return lambda t: edit.fn(t, ctx)


def _mirror_back(output: Any, mirror: list[tuple[Tensor, Tensor, int]]) -> Any:
    """Undo the input stand-ins' side effects: in-place changes the layer made to a stand-in
    are copied to the caller's tensor, and a returned stand-in is the caller's tensor again."""
    swap = {}
    for x, s, version in mirror:
        if _torch.version(s) != version:
            x.copy_(s)
            swap[id(s)] = x
    if not swap:
        return output
    return _tree.map_tensors(lambda p, t: swap.get(id(t), t), output)


def _all_names_of(x: Tensor, bound: Any, chosen: set[Any], edit: Edit, name: str) -> None:
    """An input-gradient edit must cover every argument that is the same tensor: the layer
    would see different tensors otherwise (``query is key`` decides attention's path)."""
    names = [p for p, t in _tree.leaves(bound) if t is x]
    if not set(names) <= chosen:
        shown = ", ".join(_tree.path_str(p).lstrip(".") or "input" for p in names)
        raise EditError(
            f"cannot edit the gradient of one argument of {name!r} alone: {shown} are the "
            f"same tensor, and their gradients through the layer cannot be told apart without "
            f"giving the layer different tensors. Edit them together (at='*')."
        )


def _tensor_at(edit: Edit, tree: Any, name: str, path: Any) -> Tensor:
    value = _tree.get(tree, path)
    if not isinstance(value, Tensor):
        raise EditError(
            f"edit {edit.name!r} on {name!r}: {edit.on}{_tree.path_str(path)} is "
            f"{type(value).__name__}, not a tensor"
        )
    return value


def _needs_grad(t: Tensor, edit: Edit, name: str, path: Any) -> None:
    if not t.requires_grad:
        raise EditError(
            f"cannot edit the gradient of {name!r} {edit.on}{_tree.path_str(path)}: it has no "
            f"gradient because {why_no_grad()}"
        )


def _as_edits(value: Any) -> list[Edit]:
    if isinstance(value, Edit):
        return [value]
    if isinstance(value, (list, tuple)):
        return [e for v in value for e in _as_edits(v)]
    if callable(value):
        return [transform(value)]
    raise UsageError(
        f"cannot edit with {value!r}: give an Edit (hookscope.scale(...), ablate(), ...), a "
        "function tensor -> tensor, or a list of them"
    )


edit = Editor
"""Temporarily edit layers' outputs, inputs or gradients: ``hs.edit(model, edits)`` is
:class:`Editor` (the same class, named for ``with hs.edit(...)``), as ``hs.capture`` is
:class:`Capture`.

Example:
    >>> import torch, torch.nn as nn, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> with hs.edit(model, {"1": hs.ablate()}):
    ...     out = model(torch.ones(2, 3))
    >>> torch.equal(out, model[2].bias.expand(2, 1))
    True
"""
