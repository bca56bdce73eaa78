"""Layer names and selectors.

Names are ``named_modules()`` dotted paths of the *unwrapped* model: the ``module.`` of
``nn.DataParallel`` / ``DistributedDataParallel`` and the ``_orig_mod.`` of ``torch.compile``
are removed, so the same names work on the wrapped and the unwrapped model. The wrapped
spelling (``module.features``) is accepted too, and so is a second attribute name of a shared
module (``enc2`` when ``self.enc2 = self.enc``), children included (``enc2.0``).

Containers that are never called themselves (``nn.ModuleList``, ``nn.ModuleDict``: their
class has no ``forward``) are not layers: naming one explicitly is refused with a pointer to
its children, and patterns skip them.

:meth:`Layers.sites` is the one resolver every entry point uses: layers and operation sites
(``"layer::op"``, ``ops/_select.py``) alike, so a selector means the same everywhere; an entry
point that cannot hook an operation says why (``refuse_ops=``).
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import LayerNotFoundError, UsageError
from . import _torch
from ._types import LayerSelector, SingleSelector
from .ops._select import OpSelector, is_op, parse

__all__ = ["Layers", "Site", "is_called", "names", "resolve", "unwrap"]

_GLOB_CHARS = re.compile(r"[*?\[]")
_UNIMPLEMENTED = nn.Module.forward


def _wrapped(module: nn.Module) -> nn.Module | None:
    """The module a DataParallel / DDP / torch.compile wrapper stands for, else None."""
    # Type checks first: getattr of a missing attribute on a Module raises and formats an
    # AttributeError, which made name resolution the main per-capture cost.
    if type(module).__name__ == "OptimizedModule":  # torch._dynamo's compile wrapper
        inner = _torch.children(module).get("_orig_mod")
        return inner if isinstance(inner, nn.Module) else None
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        wrapped: nn.Module = module.module
        return wrapped
    return None


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost model under any DataParallel / DDP / torch.compile wrappers."""
    while (inner := _wrapped(model)) is not None:
        model = inner
    return model


def is_called(module: nn.Module) -> bool:
    """Whether the module can run (``ModuleList`` / ``ModuleDict`` have no ``forward``)."""
    if isinstance(module, torch.jit.ScriptModule):  # its forward is compiled, not a method
        return True
    return getattr(type(module), "forward", _UNIMPLEMENTED) is not _UNIMPLEMENTED


@dataclass(frozen=True, eq=False)
class Site:
    """One selected place: a layer (``op`` is None) or an operation inside a layer's own code.

    Attributes:
        name: the record key: ``"h.0.attn"``, or ``"h.0.attn::softmax#2"`` for an operation.
        module: the layer; for an operation, the module whose own code runs it (the model's
            root for ``"::op"``).
        op: the operation selector, or None for a layer.
    """

    name: str
    module: nn.Module
    op: OpSelector | None = None


class Layers:
    """The selectable modules of a model: canonical name -> module, plus wrapped aliases."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise UsageError(f"expected a torch.nn.Module, got {type(model).__name__}")
        self.root = unwrap(model)
        self.model = model
        self.modules: dict[str, nn.Module] = {}
        self.aliases: dict[str, str] = {}
        self._seen: dict[int, str] = {}  # id(module) -> first canonical name
        self._scripted: set[str] = set()  # TorchScript modules and everything inside them
        self._walk(model, "", "", False)

    def in_script(self, name: str) -> bool:
        """Whether the layer is a TorchScript module or inside one (no Python hooks run)."""
        return self.canonical(name) in self._scripted

    def _walk(self, module: nn.Module, raw: str, canon: str, scripted: bool) -> None:
        inner = _wrapped(module)
        if inner is not None:
            self._walk(inner, f"{raw}.{_link(module)}" if raw else _link(module), canon, scripted)
            return
        first = self._seen.get(id(module))
        if first is not None:  # registered twice: its first name is canonical, like
            if canon and canon != first:  # named_modules(); the second is an alias,
                self.aliases.setdefault(canon, first)  # and so are its children's names
                for sub, _ in module.named_modules(prefix=canon):
                    if sub != canon:
                        self.aliases.setdefault(sub, first + sub[len(canon) :])
            return
        self._seen[id(module)] = canon
        scripted = scripted or isinstance(module, torch.jit.ScriptModule)
        if canon:
            self.modules[canon] = module
            if scripted:
                self._scripted.add(canon)
        if canon and raw != canon:
            self.aliases[raw] = canon
        for key, child in _torch.children(module).items():
            if child is not None:
                self._walk(
                    child,
                    f"{raw}.{key}" if raw else key,
                    f"{canon}.{key}" if canon else key,
                    scripted,
                )

    def canonical(self, name: str) -> str:
        """The canonical spelling of a layer name (aliases resolved), or of an operation
        site's (``"layer::op"``, see ``_ops``: its layer part)."""
        found = self.aliases.get(name)
        if found is not None:
            return found
        layer, sep, op = name.partition("::")
        return f"{self.aliases.get(layer, layer)}::{op}" if sep else name

    def name_of(self, module: nn.Module) -> str | None:
        """The canonical name of ``module`` in this model (wrappers seen through), or None."""
        target = unwrap(module)
        for name, mod in self.modules.items():
            if mod is target:
                return name
        return None

    def sites(self, selector: LayerSelector, *, refuse_ops: str | None = None) -> dict[str, Site]:
        """Resolve layer and operation selectors to ``{record name: Site}``, in first-seen
        order; raise before any forward if a layer part misses. ``refuse_ops``: this entry
        point cannot hook operations, and this says why (and what to select instead)."""
        out: dict[str, Site] = {}
        for item in _items(selector):
            if not is_op(item):
                for name in self._found(item):
                    out.setdefault(name, Site(name, self.modules[name]))
                continue
            assert isinstance(item, str)
            if refuse_ops is not None:
                raise UsageError(f"{item!r} selects an operation inside a layer: {refuse_ops}")
            module, op, k = parse(item)
            for name, found in self._op_owners(item, module).items():
                spec = OpSelector(name, op, k)
                out.setdefault(spec.name, Site(spec.name, found, spec))
        return out

    def select(self, selector: LayerSelector) -> dict[str, nn.Module]:
        """Resolve a selector of layers (modules only) to ``{name: module}``; raise before any
        forward if it misses. Entry points resolve with :meth:`sites`."""
        sites = self.sites(selector, refuse_ops="select the layer itself")
        return {name: site.module for name, site in sites.items()}

    def _found(self, item: SingleSelector) -> list[str]:
        found = self._match(item)
        if not found:
            raise LayerNotFoundError(self._miss_message(item))
        return found

    def _op_owners(self, text: str, module: str) -> dict[str, nn.Module]:
        if module == "":
            return {"": self.root}
        try:
            return {name: self.modules[name] for name in self._found(module)}
        except LayerNotFoundError as e:
            raise LayerNotFoundError(f"operation selector {text!r}: {e}") from None

    def _match(self, item: SingleSelector) -> list[str]:
        if isinstance(item, str) or (isinstance(item, nn.Module) and unwrap(item) is self.root):
            explicit = self._explicit(item)
            if explicit is not None:
                return explicit
        if isinstance(item, str):
            if _GLOB_CHARS.search(item):
                rx = _glob_regex(item)
                hits = [n for n in self.modules if rx.fullmatch(n)]
                hits = hits or [self.aliases[a] for a in self.aliases if rx.fullmatch(a)]
                return self._called(hits)
            return []
        if isinstance(item, re.Pattern):
            return self._called([n for n in self.modules if item.fullmatch(n)])
        if isinstance(item, type):
            if not issubclass(item, nn.Module):
                raise UsageError(
                    f"cannot select layers with the type {item.__name__}: a type selector must "
                    "be an nn.Module subclass (e.g. nn.Conv2d)"
                )
            return self._called([n for n, m in self.modules.items() if isinstance(m, item)])
        if isinstance(item, nn.Module):
            found = self.name_of(item)
            if found is not None and not is_called(item):
                raise UsageError(self._container_message(found))
            return [found] if found is not None else []
        if callable(item):
            return self._called(self._predicate_hits(item))
        raise UsageError(
            f"cannot select layers with {item!r} ({type(item).__name__}): use a name or glob "
            "string, a compiled regex, a module type, a module object or a predicate"
        )

    def _explicit(self, item: str | nn.Module) -> list[str] | None:
        """An exact name (or the root module object); None for anything else."""
        if isinstance(item, nn.Module) or item == "":
            raise UsageError(
                f"the model itself ({type(self.root).__name__}, the root module) is not a "
                "layer: its output is what model(...) returns. Select one of its layers "
                "(list them with hookscope.names(model))."
            )
        name = self.canonical(item)
        if name not in self.modules:
            return None
        if not is_called(self.modules[name]):
            raise UsageError(self._container_message(name))
        return [name]

    def _container_message(self, name: str) -> str:
        module = self.modules[name]
        kids = [f"{name}.{k}" for k, _ in module.named_children()][:3]
        return (
            f"{name!r} is a {type(module).__name__}, a container that is never called itself, "
            f"so it has no inputs or outputs to capture. Select its children instead "
            f"({', '.join(map(repr, kids))}, ... or the glob '{name}.*')."
        )

    def _called(self, hits: list[str]) -> list[str]:
        return [n for n in hits if is_called(self.modules[n])]

    def _predicate_hits(self, fn: Callable[..., Any]) -> list[str]:
        call = _predicate(fn)
        hits = []
        for name, module in self.modules.items():
            try:
                if call(name, module):
                    hits.append(name)
            except Exception as e:
                raise UsageError(
                    f"the layer predicate {getattr(fn, '__name__', fn)!r} raised "
                    f"{type(e).__name__}: {e} on layer {name!r} ({type(module).__name__})"
                ) from e
        return hits

    def miss_message(self, name: str, what: str) -> str:
        """Message for a name that is not among ``what`` (e.g. a capture's layers)."""
        close = difflib.get_close_matches(name, list(self.modules), n=5, cutoff=0.5)
        hint = f" Closest names: {', '.join(map(repr, close))}." if close else ""
        return f"{name!r} is not one of {what}.{hint}"

    def _miss_message(self, item: SingleSelector) -> str:
        model = type(self.root).__name__
        if isinstance(item, nn.Module):
            return (
                f"the {type(item).__name__} module given as a selector is not part of this "
                f"{model}. List the model's layers with hookscope.names(model)."
            )
        what = item.pattern if isinstance(item, re.Pattern) else item
        if isinstance(item, type):
            what = item.__name__
        elif callable(item) and not isinstance(item, str):
            what = getattr(item, "__name__", "predicate")
        msg = f"no layer of {model} matches {what!r}"
        if isinstance(what, str):
            close = difflib.get_close_matches(what, list(self.modules), n=5, cutoff=0.5)
            if close:
                msg += f". Closest names: {', '.join(map(repr, close))}"
            if isinstance(item, str) and "*" in item and "**" not in item:
                msg += (
                    ". In globs '*' stays within one dotted segment; "
                    "use '**' to cross dots (e.g. 'layer*.**.conv2')"
                )
            if isinstance(item, re.Pattern):
                msg += ". Regexes must match the whole name (re.fullmatch)"
        return msg + ". List the selectable names with hookscope.names(model)."


def _items(selector: LayerSelector) -> Sequence[SingleSelector]:
    if isinstance(selector, (list, tuple)):
        if not selector:
            raise LayerNotFoundError("empty layer selection: name at least one layer")
        return selector
    return [selector]  # type: ignore[list-item]


def _link(wrapper: nn.Module) -> str:
    return "_orig_mod" if hasattr(wrapper, "_orig_mod") else "module"


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Glob -> regex: ``*`` and ``?`` stay within a dotted segment, ``**`` crosses dots."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**.", i):
            out.append(r"(?:[^.]+\.)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(r".*")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append(r"[^.]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(pattern[i:]))
                break
            out.append(pattern[i : end + 1].replace("[!", "[^"))
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _predicate(fn: Callable[..., Any]) -> Callable[[str, nn.Module], bool]:
    """Call a one-argument predicate with the module, a two-argument one with (name, module)."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
        two = len(params) >= 2
    except (TypeError, ValueError):  # builtins without a signature
        two = False
    if two:
        return lambda name, module: bool(fn(name, module))
    return lambda name, module: bool(fn(module))


def resolve(model: nn.Module, selector: LayerSelector) -> dict[str, nn.Module]:
    """``{canonical name: module}`` for a selector; raises LayerNotFoundError on a miss."""
    return Layers(model).select(selector)


def names(model: nn.Module, layers: LayerSelector | None = None) -> dict[str, str]:
    """The selectable layers of ``model``: dotted name -> module type name.

    Names are those of ``named_modules()`` on the unwrapped model, so they are the same for
    ``model``, ``nn.DataParallel(model)`` and ``torch.compile(model)``. Containers that are
    never called (``nn.ModuleList``, ``nn.ModuleDict``) are listed, since their names prefix
    their children's, but cannot be captured themselves: their type name says so,
    ``"ModuleList (container)"``.

    Args:
        model: any ``nn.Module``, wrapped or not.
        layers: optionally, a selector to preview what it matches.

    Returns:
        An ordered dict of name to type name (``" (container)"`` added for containers), in
        ``named_modules()`` order.

    Raises:
        LayerNotFoundError: ``layers`` matches nothing.

    Example:
        >>> import torch.nn as nn, hookscope as hs
        >>> hs.names(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        {'0': 'Linear', '1': 'ReLU'}
        >>> hs.names(nn.ModuleDict({"blocks": nn.ModuleList([nn.ReLU()])}))
        {'blocks': 'ModuleList (container)', 'blocks.0': 'ReLU'}
    """
    known = Layers(model)
    if layers is not None:
        known.sites(layers, refuse_ops=_NAMES_OPS)
    chosen = known.modules if layers is None else known.select(layers)
    if layers is not None:
        order = list(known.modules)
        chosen = dict(sorted(chosen.items(), key=lambda kv: order.index(kv[0])))
    return {
        name: _type_name(module) + ("" if is_called(module) else CONTAINER)
        for name, module in chosen.items()
    }


#: what ``names`` adds to a container's type name (it is never called: nothing to capture)
CONTAINER = " (container)"


_NAMES_OPS = (
    "hookscope.names(model, layers) previews the layers a selector picks; list the operations "
    "of a layer's own code with hookscope.names(model, 'layer', ops=True, inputs=...)"
)


def _type_name(module: nn.Module) -> str:
    """The module's class name; a TorchScript module's is the class it was scripted from."""
    if isinstance(module, torch.jit.ScriptModule):
        return str(getattr(module, "original_name", type(module).__name__))
    return type(module).__name__
