"""Operations inside a module's call: selectors ``"layer::op"`` and how hookscope sees them.

A module hook sees what a module receives and returns; the softmax inside its ``forward``,
the attention probabilities inside ``F.scaled_dot_product_attention`` or a functional
``F.relu`` never leave it. An *operation selector* names them:

* ``"transformer.h.3.attn::softmax"``: every call of ``softmax`` that the module's own code
  makes, one record per call (several per module call if it calls softmax several times);
* ``"transformer.h.3.attn::matmul#2"``: the second ``matmul`` of each call of the module
  (``#k`` counts from 1 and restarts with every call of the module);
* ``"::softmax"``: the model's own ``forward`` (a hand-written functional model);
* ``"transformer.h.*.attn::scaled_dot_product_attention"``: the module part is any layer
  name or glob; ``"...::attention_weights"`` is the probabilities of an SDPA call
  (``_attention``).

This module is the vocabulary only (names, parsing, how arguments are named); it imports
nothing of the session machinery.

**Which operations.** Every call of a function or method that goes through PyTorch's
``__torch_function__`` (``torch.*``, ``torch.nn.functional.*``, ``Tensor`` methods and
operators, ``x.shape``-like properties), counted by name: ``torch.softmax``, ``F.softmax``
and ``x.softmax`` are all ``softmax``; ``x @ y`` is ``matmul``, ``1 - x`` is ``sub``, ``x[i]``
is ``getitem``, in-place methods keep their ``_`` (``add_``). A call counts once, at the
level the module's code made it: what ``F.scaled_dot_product_attention`` runs inside is not
seen. Only the module's **own code** counts: what its child modules run belongs to them
(``attn.c_attn::addmm``, not ``attn::addmm``), and so does what hooks on it run (another
session's copies, a user's hook), so that numbers do not move when something else is hooked.
Calls that return no tensor (``size()``, ``dim()``) are numbered but never listed.

**How** (``_watch``): a ``TorchFunctionMode`` is on the stack only while a selected
module's call runs, and each call it intercepts finds its owner on the Python stack.

**Resolution.** The module part resolves when the session is built, like any layer
selector (``Layers.sites`` in ``core/_naming.py``, the one resolver of every entry point); the
operation part on the first forward that runs the module: a selector that matched none of its
calls then raises, naming the operations that did run there.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import UsageError
from .. import _torch
from .._bind import Binder

__all__ = [
    "METADATA",
    "SDPA",
    "SEP",
    "WEIGHTS",
    "OpSelector",
    "forward_op",
    "is_op",
    "op_binder",
    "op_name",
    "op_qualname",
    "parse",
    "sdpa_signature",
]

SEP = "::"
SDPA = "scaled_dot_product_attention"
#: the virtual operation: an SDPA call's attention probabilities (``_attention``)
WEIGHTS = "attention_weights"
_OP = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:#(\d+))?")

# -- names ----------------------------------------------------------------------------------------
#: reflected and augmented operators are the operator's own name (``1 - x`` is ``sub``)
_BINARY = {"add", "sub", "mul", "div", "truediv", "floordiv", "matmul", "pow", "mod"}
_BINARY |= {"and", "or", "xor", "lshift", "rshift"}
_DUNDER = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder"}
_DUNDER |= {"and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor"}
_DUNDER |= {"lshift": "bitwise_left_shift", "rshift": "bitwise_right_shift"}
_DUNDER |= {"invert": "bitwise_not"}
_NAMES: dict[Any, str] = {}
_FUNCTION = types.FunctionType
#: calls that only read a tensor's metadata, left out of messages (listings leave out every
#: call that returned no tensor, which they see)
METADATA = {"shape", "size", "dim", "ndim", "numel", "dtype", "device", "stride", "len"}
METADATA |= {"is_floating_point", "is_complex", "is_contiguous", "requires_grad", "item"}
METADATA |= {"element_size", "storage_offset", "data_ptr", "layout", "is_leaf", "grad_fn"}


def _plain_name(func: Any) -> str:
    name = str(getattr(func, "__name__", None) or type(func).__name__)
    if name == "__get__":  # a Tensor property (x.shape, x.mT): name the property
        name = str(getattr(getattr(func, "__self__", None), "__name__", name))
    if len(name) > 4 and name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core[:1] == "i" and core[1:] in _BINARY:
            return _DUNDER.get(core[1:], core[1:]) + "_"
        if core[:1] == "r" and core[1:] in _BINARY:
            core = core[1:]
        return _DUNDER.get(core, core)
    return name


def op_name(func: Any) -> str:
    """The name an operation selector uses for ``func`` (see the module docstring)."""
    # functions are keyed by code: a closure made per call must not grow the cache
    key = func.__code__ if type(func) is _FUNCTION else func
    name = _NAMES.get(key)
    if name is None:
        name = _NAMES[key] = _plain_name(func)
    return name


def op_qualname(func: Any) -> str:
    """How the code called it, for listings: ``torch.nn.functional.softmax``,
    ``torch.Tensor.softmax``, ``torch.matmul``."""
    kind = type(func).__name__
    if kind in ("method_descriptor", "wrapper_descriptor", "method-wrapper"):
        return f"torch.Tensor.{_plain_name(func) if kind == 'method-wrapper' else func.__name__}"
    name = str(getattr(func, "__name__", ""))
    for public, where in ((F, "torch.nn.functional"), (torch, "torch")):
        if name and getattr(public, name, None) is func:
            return f"{where}.{name}"
    module = str(getattr(func, "__module__", None) or "torch").replace("torch._tensor", "torch")
    return f"{module}.{getattr(func, '__qualname__', name)}"


# -- selectors ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpSelector:
    """A resolved operation selector: the module's canonical name (``""`` for the model
    itself), the operation's name and which call of it (``k``, from 1; None for every)."""

    module: str
    op: str
    k: int | None

    @property
    def name(self) -> str:
        """The record key: ``"h.3.attn::matmul#2"``."""
        return f"{self.module}{SEP}{self.op}" + (f"#{self.k}" if self.k else "")


def is_op(item: object) -> bool:
    """Whether one selector item is an operation selector (a ``"layer::op"`` string)."""
    return isinstance(item, str) and SEP in item


def parse(text: str) -> tuple[str, str, int | None]:
    """``"layer::op#k"`` -> ``("layer", "op", k)``; refuses a malformed operation part."""
    module, _, rest = text.partition(SEP)
    match = _OP.fullmatch(rest)
    if match is None or (match.group(2) is not None and int(match.group(2)) < 1):
        raise UsageError(
            f"bad operation selector {text!r}: write 'layer::op' (every call of op in the "
            "layer's own code) or 'layer::op#k' (its k-th call, from 1), e.g. "
            "'transformer.h.0.attn::softmax' or 'encoder::matmul#2'; '::op' is the model's "
            "own forward"
        )
    return module, match.group(1), int(match.group(2)) if match.group(2) else None


def forward_op(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run an intercepted operation. Every handler runs the call it intercepted through here,
    so that sessions below it still see the call as the module's (see ``OpWatch.owner``),
    and so do the user's function modes, which a handler's own work is hidden from
    (``_lifetime.run_unseen``)."""
    return _call_shown(func, args, kwargs)


_call_shown = _torch.call_shown
_BINDERS: dict[Any, Binder] = {}


def sdpa_signature(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> None:
    """``F.scaled_dot_product_attention``'s parameters (a builtin has no readable signature):
    captured inputs are named after them."""


def op_binder(func: Any) -> Binder:
    """How an operation's arguments are named: after the function's parameters where Python
    can read them (``F.softmax``: ``input``, ``dim``...; SDPA: ``query``, ``key``, ``value``,
    ``attn_mask``...), else ``arg0``, ``arg1``... (cached per function)."""
    python = type(func) is types.FunctionType
    key = func.__code__ if python else func
    binder = _BINDERS.get(key)
    if binder is None:
        target = sdpa_signature if not python and op_name(func) == SDPA else func
        binder = _BINDERS[key] = Binder(target)
    return binder
