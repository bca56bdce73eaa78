"""A zoo of tiny, awkward models for registry-parametrised contract tests.

Every entry is a factory returning ``(model, args, kwargs)`` (fresh model, seeded, so two
builds are identical) plus metadata: which layers are interesting, which return nested
outputs, which run more than once per forward, which are overwritten in place after they
return, and so on. ``ZOO`` maps an entry's name to its :class:`ZooEntry`.

The helpers below (``unwrap``, ``tree_map``, ``HandHooks``, ...) are the *independent
oracle*: plain ``register_forward_hook`` / ``inspect`` / autograd code that never imports
hookscope, so tests can compare hookscope against them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Example = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class ZooEntry:
    """One zoo model and what is special about it.

    Attributes:
        name: registry key.
        build: factory returning a fresh ``(model, args, kwargs)``.
        layers: interesting layer names (canonical: no ``module.`` / ``_orig_mod.``).
        nested: layers whose output is a container (tuple, dict, dataclass, ...).
        reused: layer -> how many times it runs per forward (when more than once).
        inplace: layers whose output is overwritten in place after their forward hook ran.
        not_run: layers that exist but never run through ``__call__`` (hooks do not fire).
        raises: the exception type the forward raises, if it raises.
        wrapper: ``"dp"`` (nn.DataParallel) or ``"compile"`` (torch.compile, eager backend).
        mutates: a forward changes the model (BatchNorm running stats in train mode).
        float_grads: the gradient contract applies (float outputs that require grad).
        shared_outputs: layers returning a tensor they also used themselves to compute
            another returned tensor (``return h, fc(h)``): d loss / d h from downstream
            differs from h's total gradient.
        aliased: layer -> groups of argument names given the same tensor (``mix(h, h)``):
            the gradient through the layer w.r.t. that tensor is reported under each name
            (the sum of the per-argument gradients), since the layer must see one tensor.
    """

    name: str
    build: Callable[[], Example]
    layers: tuple[str, ...]
    nested: tuple[str, ...] = ()
    reused: Mapping[str, int] = field(default_factory=dict)
    inplace: tuple[str, ...] = ()
    not_run: tuple[str, ...] = ()
    raises: type[BaseException] | None = None
    wrapper: str | None = None
    mutates: bool = False
    float_grads: bool = True
    shared_outputs: tuple[str, ...] = ()
    aliased: Mapping[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)


ZOO: dict[str, ZooEntry] = {}


def register(name: str, **meta: Any) -> Callable[[Callable[[], Example]], Callable[[], Example]]:
    def deco(build: Callable[[], Example]) -> Callable[[], Example]:
        assert name not in ZOO, name
        ZOO[name] = ZooEntry(name, build, **meta)
        return build

    return deco


class ZooError(ValueError):
    """Raised by the ``raises`` zoo model halfway through its forward."""


# ---------------------------------------------------------------------------------------
# Independent helpers (no hookscope)
# ---------------------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    """Strip DataParallel / DDP / torch.compile wrappers."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif type(model).__name__ == "OptimizedModule":
            model = model._orig_mod
        else:
            return model


def layer_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every named submodule of the unwrapped model that can be called (root excluded, and
    containers without a forward of their own, such as ModuleList, left out)."""
    return {
        n: m
        for n, m in unwrap(model).named_modules()
        if n and type(m).forward is not nn.Module.forward
    }


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def tree_map(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    """Apply ``fn`` to every tensor in a nested tuple/list/dict/namedtuple/dataclass."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if _is_namedtuple(obj):
        return type(obj)(*(tree_map(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map(fn, v) for v in obj)
    if isinstance(obj, Mapping):
        items = {k: tree_map(fn, v) for k, v in obj.items()}
        if dataclasses.is_dataclass(obj):  # HF ModelOutput
            return type(obj)(**items)
        return type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: tree_map(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        )
    return obj


def tree_map_path(
    fn: Callable[[tuple[Any, ...], Tensor], Any], obj: Any, path: tuple[Any, ...] = ()
) -> Any:
    """Like :func:`tree_map`, with ``fn(path, tensor)``."""
    if isinstance(obj, Tensor):
        return fn(path, obj)
    if _is_namedtuple(obj):
        return type(obj)(*(tree_map_path(fn, v, (*path, i)) for i, v in enumerate(obj)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(tree_map_path(fn, v, (*path, i)) for i, v in enumerate(obj))
    if isinstance(obj, Mapping):
        items = {k: tree_map_path(fn, v, (*path, k)) for k, v in obj.items()}
        return type(obj)(**items) if dataclasses.is_dataclass(obj) else type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj,
            **{
                f.name: tree_map_path(fn, getattr(obj, f.name), (*path, f.name))
                for f in dataclasses.fields(obj)
            },
        )
    return obj


def tree_leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Tensor]]:
    """``(path, tensor)`` for every tensor leaf, depth first."""
    if isinstance(obj, Tensor):
        yield path, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from tree_leaves(v, (*path, i))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from tree_leaves(v, (*path, k))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tree_leaves(getattr(obj, f.name), (*path, f.name))


def tree_get(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key] if isinstance(obj, (tuple, list, Mapping)) else getattr(obj, key)
    return obj


def assert_same_tree(
    actual: Any, expected: Any, *, exact: bool = True, where: str = "value", **close: Any
) -> None:
    """Same container types and keys; tensor leaves equal (bit-exact unless ``exact=False``)."""
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{where}: expected a tensor, got {type(actual)}"
        assert actual.shape == expected.shape, f"{where}: {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"{where}: {actual.dtype} != {expected.dtype}"
        if exact:
            assert torch.equal(actual, expected), f"{where}: values differ"
        else:
            torch.testing.assert_close(actual, expected, msg=lambda m: f"{where}: {m}", **close)
        return
    assert type(actual) is type(expected), f"{where}: {type(actual)} is not {type(expected)}"
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_tree(a, e, exact=exact, where=f"{where}[{i}]", **close)
    elif isinstance(expected, Mapping):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_same_tree(actual[k], expected[k], exact=exact, where=f"{where}[{k!r}]", **close)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same_tree(
                getattr(actual, f.name),
                getattr(expected, f.name),
                exact=exact,
                where=f"{where}.{f.name}",
                **close,
            )
    else:
        assert actual == expected or actual is expected, f"{where}: {actual!r} != {expected!r}"


def clone_tree(obj: Any) -> Any:
    return tree_map(lambda t: t.detach().clone(), obj)


def bind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by ``forward`` parameter name (what ``inputs=True`` should give):
    ``*args`` entries named by absolute position (``arg2``), ``**kwargs`` entries by key."""
    sig = inspect.signature(module.forward)
    out: dict[str, Any] = {}
    for name, value in sig.bind(*args, **kwargs).arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            first = len(args) - len(value)
            out.update({f"arg{first + i}": v for i, v in enumerate(value)})
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


def make_loss(output: Any) -> Tensor:
    """A scalar with non-uniform gradients w.r.t. every float leaf that requires grad."""
    total: Tensor | None = None
    for _, t in tree_leaves(output):
        if t.is_floating_point() and t.requires_grad:
            pattern = torch.sin(torch.arange(t.numel(), dtype=t.dtype)).reshape(t.shape) + 0.25
            term = (t * pattern).sum()
            total = term if total is None else total + term
    assert total is not None, "the model output has no float leaf that requires grad"
    return total


def call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return model(*args, **kwargs)


@dataclass
class HandCall:
    output: Any  # clone at module exit
    inputs: dict[str, Any] | None  # clone at module entry, bound by name
    live: list[tuple[Tensor, int]]  # live output leaves and their _version at exit
    start: int = -1  # this call's position in start (pre-hook) order
    edits_inputs: bool = False  # the layer modified one of its input tensors in place
    live_output: Any = None  # the live (un-cloned, undetached) output


class HandHooks:
    """Reference recorder: plain forward (pre-)hooks storing ``detach().clone()`` per call.

    ``records[name]`` is the list of :class:`HandCall`, in completion order; inputs are
    paired with outputs through a per-module stack (recursion safe).
    """

    def __init__(self, modules: Mapping[str, nn.Module], *, keep_live: bool = False) -> None:
        self.modules = dict(modules)
        self.keep_live = keep_live
        self.records: dict[str, list[HandCall]] = {n: [] for n in self.modules}
        self._stacks: dict[str, list[tuple[int, dict[str, Any], list[tuple[Tensor, int]]]]] = {
            n: [] for n in self.modules
        }
        self._starts: dict[str, int] = {n: 0 for n in self.modules}
        self._handles: list[Any] = []

    def __enter__(self) -> HandHooks:
        for name, mod in self.modules.items():
            self._handles.append(
                mod.register_forward_pre_hook(self._pre(name, mod), with_kwargs=True)
            )
            self._handles.append(mod.register_forward_hook(self._post(name)))
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, name: str, mod: nn.Module) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            bound = bind(mod, args, kwargs)
            versions = [(t, t._version) for _, t in tree_leaves(bound)]
            self._stacks[name].append((self._starts[name], clone_tree(bound), versions))
            self._starts[name] += 1

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            start, inputs, versions = self._stacks[name].pop()
            live = [(t, t._version) for _, t in tree_leaves(out)]
            edits = any(t._version != v for t, v in versions)
            self.records[name].append(
                HandCall(
                    clone_tree(out), inputs, live, start, edits, out if self.keep_live else None
                )
            )

        return hook

    def overwritten(self, name: str, k: int) -> bool:
        """Whether call k's output was modified in place after the hook (version oracle)."""
        return any(t._version != v for t, v in self.records[name][k].live)


GradMap = dict[tuple[Any, ...], "Tensor | None"]


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() and t.requires_grad


def reference_output_grads(
    model: nn.Module, mods: dict[str, nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, list[GradMap]]:
    """d loss / d output of every call of every layer, by plain autograd.grad.

    Each forward hook keeps ``c = out * 1`` and hands on ``c * 1``: ``c`` is used by nothing
    else (an ``nn.Identity`` returns its input object, whose total gradient would include
    other uses; ``return h, fc(h)`` uses ``h`` inside), and later in-place ops modify the copy
    handed on, so ``c`` stays the layer's output as it left the layer. Except when the layer
    changed one of its inputs in place and returned it (ReLU(inplace=True)): the caller may
    go on with that tensor under its own name (``self.act(h); use(h)``), so it is handed on
    untouched and its gradient taken at the autograd edge it had when the layer returned
    (``get_gradient_edge``), which later in-place ops do not move.
    """
    live: dict[str, list[Any]] = {n: [] for n in mods}
    entered: dict[str, list[dict[int, int]]] = {n: [] for n in mods}

    def pre(name: str) -> Callable[..., None]:
        def hook(m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
            entered[name].append({id(t): t._version for _, t in tree_leaves((a, kw))})

        return hook

    def post(name: str) -> Callable[..., Any]:
        def hook(m: nn.Module, a: tuple[Any, ...], out: Any) -> Any:
            inputs = entered[name].pop()

            def mark(t: Tensor) -> Any:
                if not _differentiable(t):
                    return t
                if id(t) in inputs and inputs[id(t)] != t._version:  # changed in place
                    return ("edge", torch.autograd.graph.get_gradient_edge(t), t)
                return ("copy", t * 1)

            marked = tree_map(mark, out)
            live[name].append(marked)
            return tree_map(lambda t: t, out) if not _has_copy(marked) else _handed_on(marked)

        return hook

    handles = [m.register_forward_pre_hook(pre(n), with_kwargs=True) for n, m in mods.items()]
    handles += [m.register_forward_hook(post(n)) for n, m in mods.items()]
    try:
        loss = make_loss(model(*args, **kwargs))
    finally:
        for h in handles:
            h.remove()
    keys, targets = [], []
    for name, outs in live.items():
        for k, out in enumerate(outs):
            for path, entry in _marked_leaves(out):
                keys.append((name, k, path))
                targets.append(entry[1])
    grads = torch.autograd.grad(loss, targets, allow_unused=True)
    found = dict(zip(keys, grads))
    return {
        name: [
            {p: found.get((name, k, p)) for p, _ in _all_leaves(out)} for k, out in enumerate(outs)
        ]
        for name, outs in live.items()
    }


def _marked_leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """``(path, ("copy", tensor) | ("edge", edge, tensor))`` for every differentiable leaf."""
    for p, leaf in _all_leaves(obj, path):
        if isinstance(leaf, tuple):
            yield p, leaf


def _all_leaves(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every tensor leaf of the original output (a marked tuple counts as one leaf)."""
    if isinstance(obj, tuple) and obj and obj[0] in ("copy", "edge"):
        yield path, obj
        return
    if isinstance(obj, Tensor):
        yield path, obj
        return
    if isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _all_leaves(v, (*path, i))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _all_leaves(v, (*path, k))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _all_leaves(getattr(obj, f.name), (*path, f.name))


def _has_copy(marked: Any) -> bool:
    return any(leaf[0] == "copy" for _, leaf in _marked_leaves(marked))


def _handed_on(marked: Any) -> Any:
    """The output to hand on: each copied leaf as ``c * 1``, every other leaf as it was."""

    def unmark(obj: Any) -> Any:
        if isinstance(obj, tuple) and obj and obj[0] == "copy":
            return obj[1] * 1
        if isinstance(obj, tuple) and obj and obj[0] == "edge":
            return obj[2]
        return obj

    return _map_marked(unmark, marked)


def _map_marked(fn: Callable[[Any], Any], obj: Any) -> Any:
    if isinstance(obj, tuple) and obj and obj[0] in ("copy", "edge"):
        return fn(obj)
    if isinstance(obj, Tensor):
        return obj
    if _is_namedtuple(obj):
        return type(obj)(*(_map_marked(fn, v) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_marked(fn, v) for v in obj)
    if isinstance(obj, Mapping):
        items = {k: _map_marked(fn, v) for k, v in obj.items()}
        return type(obj)(**items) if dataclasses.is_dataclass(obj) else type(obj)(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _map_marked(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        )
    return obj


def with_aliases(grads: dict[Any, Any], groups: tuple[tuple[str, ...], ...]) -> dict[Any, Any]:
    """Per-argument reference gradients as hookscope reports arguments that are one tensor:
    each name of a group gets the group's sum."""
    out = dict(grads)
    for group in groups:
        keys = [k for k in grads if k and k[0] in group and grads[k] is not None]
        if keys:
            total = sum(grads[k] for k in keys)
            out.update(dict.fromkeys(keys, total))
    return out


def reference_input_grads(
    model: nn.Module,
    module: nn.Module,
    start: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> GradMap:
    """Gradient flowing through ``module``'s ``start``-th call into each tensor input.

    The call's differentiable inputs are replaced by fresh leaves (cloned, so in-place
    modules stay legal): autograd.grad w.r.t. those leaves is exactly what flows through
    this one call, not the input's total gradient (which includes skip connections). If the
    layer changes such a clone in place, the change is copied back into the caller's tensor
    (and a returned clone is swapped back for it), since the caller may go on with it.
    """
    leaves: dict[tuple[Any, ...], Tensor] = {}
    paths: list[tuple[Any, ...]] = []
    seen = [0]
    clones: list[tuple[Tensor, Tensor, int]] = []  # (caller's tensor, clone, clone version)

    def pre(m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        index, seen[0] = seen[0], seen[0] + 1
        if index != start:
            return None
        bound = inspect.signature(m.forward).bind(*a, **kw)

        def cut(path: tuple[Any, ...], t: Tensor) -> Tensor:
            paths.append(path)
            if not _differentiable(t):
                return t
            leaves[path] = leaf = t.detach().requires_grad_()
            clone = leaf.clone()
            clones.append((t, clone, clone._version))
            return clone

        for pname, value in list(bound.arguments.items()):
            bound.arguments[pname] = tree_map_path(cut, value, (pname,))
        return bound.args, bound.kwargs

    def post(m: nn.Module, a: tuple[Any, ...], out: Any) -> Any:
        back = {id(c): t for t, c, v in clones if c._version != v}
        for t, c, v in clones:
            if c._version != v:
                t.copy_(c)
        clones.clear()
        return tree_map(lambda x: back.get(id(x), x), out) if back else None

    handles = [module.register_forward_pre_hook(pre, with_kwargs=True)]
    handles.append(module.register_forward_hook(post))
    try:
        loss = make_loss(model(*args, **kwargs))
    finally:
        for h in handles:
            h.remove()
    found: dict[tuple[Any, ...], Tensor | None] = {}
    if leaves:
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        found = dict(zip(leaves, grads))
    return {p: found.get(p) for p in paths}


# ---------------------------------------------------------------------------------------
# The zoo
# ---------------------------------------------------------------------------------------
def _seed() -> None:
    torch.manual_seed(0)


class Reused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(3):
            x = torch.tanh(self.fc(x))
        return self.out(x)


@register("reused", layers=("fc", "out"), reused={"fc": 3})
def _reused() -> Example:
    _seed()
    return Reused(), (torch.randn(2, 4),), {}


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


@register("tied", layers=("emb", "mix", "head"))
def _tied() -> Example:
    _seed()
    return TiedLM(), (torch.randint(0, 11, (2, 5)),), {}


@register("inplace_relu", layers=("0", "1", "2"), inplace=("0",))
def _inplace_relu() -> Example:
    _seed()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    return model, (torch.randn(3, 4),), {}


class CustomInplaceReLU(nn.Module):
    """Edits its input in place without declaring ``inplace`` (no such attribute)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x, inplace=True)


@register("inplace_custom", layers=("0", "act", "2"), inplace=("0",))
def _inplace_custom() -> Example:
    _seed()
    model = nn.Sequential(
        OrderedDict([("0", nn.Linear(4, 8)), ("act", CustomInplaceReLU()), ("2", nn.Linear(8, 3))])
    )
    return model, (torch.randn(3, 4),), {}


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(cin)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, growth, 3, padding=1, bias=False)

    def forward(self, inputs: list[Tensor]) -> Tensor:
        concated = torch.cat(inputs, 1)
        return self.conv1(self.relu1(self.norm1(concated)))


class DenseBlock(nn.Module):
    def __init__(self, cin: int, growth: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(cin + i * growth, growth) for i in range(n))

    def forward(self, x: Tensor) -> Tensor:
        feats = [x]
        for layer in self.layers:
            feats.append(layer(feats))
        return torch.cat(feats, 1)


class TinyDenseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            OrderedDict(
                conv0=nn.Conv2d(3, 4, 3, padding=1, bias=False),
                norm0=nn.BatchNorm2d(4),
                relu0=nn.ReLU(inplace=True),
                block=DenseBlock(4, 3, 2),
                norm5=nn.BatchNorm2d(10),
            )
        )
        self.classifier = nn.Linear(10, 3)

    def forward(self, x: Tensor) -> Tensor:
        features = self.features(x)
        out = F.relu(features, inplace=True)  # torchvision DenseNet does exactly this
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.classifier(out)


def _randomize_bn(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)


@register(
    "densenet",
    layers=("features", "features.norm0", "features.block.layers.0.norm1", "classifier"),
    inplace=(
        "features",
        "features.norm0",
        "features.norm5",
        "features.block.layers.0.norm1",
        "features.block.layers.1.norm1",
    ),
)
def _densenet() -> Example:
    _seed()
    model = TinyDenseNet()
    _randomize_bn(model)
    return model.eval(), (torch.randn(2, 3, 6, 6),), {}


class Bottleneck(nn.Module):
    """Like Hugging Face's ResNetBottleNeckLayer: ``hidden += residual`` after a BatchNorm."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.shortcut = nn.Identity()
        self.out_act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        residual = x
        hidden = self.bn2(self.conv2(self.act(self.bn1(self.conv1(x)))))
        hidden += self.shortcut(residual)
        return self.out_act(hidden)


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.stages = nn.Sequential(Bottleneck(4), Bottleneck(4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.stages(self.stem(x)).mean(dim=(2, 3)))


@register(
    "inplace_residual",
    layers=("stages.0", "stages.0.bn2", "stages.1.bn2", "fc"),
    inplace=("stages.0.bn2", "stages.1.bn2"),
)
def _inplace_residual() -> Example:
    _seed()
    model = TinyResNet()
    _randomize_bn(model)
    return model.eval(), (torch.randn(2, 3, 5, 5),), {}


class Split(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        a, b = self.lin(x).chunk(2, dim=-1)
        return torch.tanh(a), b * 2


class TupleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.split = Split()

    def forward(self, x: Tensor) -> Tensor:
        a, b = self.split(x)
        return a * torch.sigmoid(b)


@register("tuple_out", layers=("split", "split.lin"), nested=("split",))
def _tuple_out() -> Example:
    _seed()
    return TupleModel(), (torch.randn(3, 4),), {}


class DictHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(4, 3)
        self.logvar = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"mu": self.mu(x), "logvar": self.logvar(x)}


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = DictHead()

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        d = self.enc(x)
        return {"z": d["mu"] + torch.exp(0.5 * d["logvar"]), "kl": d["mu"].pow(2).mean()}


@register("dict_out", layers=("enc", "enc.mu"), nested=("enc",))
def _dict_out() -> Example:
    _seed()
    return DictModel(), (torch.randn(2, 4),), {}


Pair = namedtuple("Pair", ["lo", "hi"])


class PairHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Pair:
        y = self.lin(x)
        return Pair(lo=y.clamp(max=0), hi=y.clamp(min=0))


class NamedTupleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = PairHead()

    def forward(self, x: Tensor) -> Tensor:
        p = self.head(x)
        return p.hi * 2 - p.lo


@register("namedtuple_out", layers=("head", "head.lin"), nested=("head",))
def _namedtuple_out() -> Example:
    _seed()
    return NamedTupleModel(), (torch.randn(2, 4),), {}


@dataclass
class EncoderOutput:
    hidden: Tensor
    pooled: Tensor
    note: str = "zoo"


class DataclassEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x: Tensor) -> EncoderOutput:
        h = torch.tanh(self.lin(x))
        return EncoderOutput(hidden=h, pooled=h.mean(dim=1))


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = DataclassEncoder()
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> EncoderOutput:
        enc = self.encoder(x)
        return EncoderOutput(hidden=self.head(enc.hidden), pooled=enc.pooled, note="top")


@register(
    "dataclass_out", layers=("encoder", "head"), nested=("encoder",), shared_outputs=("encoder",)
)
def _dataclass_out() -> Example:
    _seed()
    return DataclassModel(), (torch.randn(2, 3, 4),), {}


class ListHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(4, 2) for _ in range(3))

    def forward(self, x: Tensor) -> list[Tensor]:
        return [lin(x) for lin in self.lins]


class ListModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = ListHead()

    def forward(self, x: Tensor) -> Tensor:
        a, b, c = self.heads(x)
        return a * b + c


@register("list_out", layers=("heads", "heads.lins.1"), nested=("heads",))
def _list_out() -> Example:
    _seed()
    return ListModel(), (torch.randn(2, 4),), {}


class KwOnlyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, *, hidden_states: Tensor, mask: Tensor) -> Tensor:
        return self.lin(hidden_states) * mask.unsqueeze(-1)


class KwOnlyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = KwOnlyBlock()
        self.head = nn.Linear(4, 2)

    def forward(self, *, hidden_states: Tensor, mask: Tensor) -> Tensor:
        return self.head(self.block(hidden_states=hidden_states, mask=mask))


@register("kwargs_only", layers=("block", "block.lin", "head"))
def _kwargs_only() -> Example:
    _seed()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    return KwOnlyModel(), (), {"hidden_states": torch.randn(2, 3, 4), "mask": mask}


class HFStyleLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.ffn = nn.Linear(4, 4)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[Tensor, ...]:
        scores = hidden_states @ self.attn(hidden_states).transpose(-1, -2)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = scores.softmax(-1)
        out = hidden_states + self.ffn(probs @ hidden_states)
        return (out, probs) if output_attentions else (out,)


class HFStyleEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList(HFStyleLayer() for _ in range(2))

    def forward(self, input_embeds: Tensor, attention_mask: Tensor) -> Tensor:
        ext = (1.0 - attention_mask[:, None, :]) * -1e4
        h = input_embeds
        for i, layer in enumerate(self.layer):
            outs = layer(hidden_states=h, attention_mask=ext, output_attentions=i == 1)
            h = outs[0]
        return h


@register(
    "hf_kwargs",
    layers=("layer.0", "layer.1", "layer.1.ffn"),
    nested=("layer.0", "layer.1"),
    shared_outputs=("layer.1",),  # returns (out, probs); out was computed from probs
)
def _hf_kwargs() -> Example:
    _seed()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    return HFStyleEncoder(), (torch.randn(2, 4, 4), mask), {}


class LSTMModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, batch_first=True)
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        out, (h, _c) = self.lstm(x)  # the cell state is unused
        return self.head(out[:, -1] + h[-1])


@register("lstm", layers=("lstm", "head"), nested=("lstm",))
def _lstm() -> Example:
    _seed()
    return LSTMModel(), (torch.randn(2, 4, 3),), {}


class GRULoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.zeros(x.shape[0], 4)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


@register("gru_cell_loop", layers=("cell", "head"), reused={"cell": 5})
def _gru_cell_loop() -> Example:
    _seed()
    return GRULoop(), (torch.randn(2, 5, 3),), {}


@register(
    "data_parallel",
    layers=("features", "features.0", "head"),
    wrapper="dp",
)
def _data_parallel() -> Example:
    _seed()
    inner = nn.Sequential(
        OrderedDict(features=nn.Sequential(nn.Linear(4, 6), nn.ReLU()), head=nn.Linear(6, 2))
    )
    return nn.DataParallel(inner), (torch.randn(3, 4),), {}


@register("compiled", layers=("0", "1", "2"), wrapper="compile")
def _compiled() -> Example:
    # torch.compile shares compiled code between instances of a class, and dynamo does not
    # guard on hooks: a fresh compiled Sequential would reuse code compiled (without hooks)
    # for another Sequential earlier in the process. Reset so this one is really fresh.
    torch._dynamo.reset()
    _seed()
    inner = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2))
    return torch.compile(inner, backend="eager"), (torch.randn(3, 4),), {}


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.b(torch.relu(self.a(x)))
        if h.shape[0] > 0:
            raise ZooError("boom after b")
        return self.c(h)


@register("raises", layers=("a", "b", "c"), not_run=("c",), raises=ZooError, float_grads=False)
def _raises() -> Example:
    _seed()
    return Raises(), (torch.randn(2, 4),), {}


class TinyAlexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(6, 6, 1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(0.5),
            nn.Linear(24, 8),
            nn.ReLU(inplace=True),
            nn.Dropout(0.5),
            nn.Linear(8, 3),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        return self.classifier(torch.flatten(x, 1))


@register(
    "alexnet",
    layers=("features.0", "features.3", "features.5", "classifier.1", "classifier.4"),
    inplace=("features.0", "features.3", "features.5", "classifier.1"),
)
def _alexnet() -> Example:
    _seed()
    return TinyAlexNet().eval(), (torch.randn(2, 3, 8, 8),), {}


class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 6)
        self.l2 = nn.Linear(6, 6)
        self.l3 = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        x = F.gelu(self.l1(x))
        x = torch.sigmoid(self.l2(x)) * F.softplus(x)
        return F.log_softmax(self.l3(x), dim=-1)


@register("functional", layers=("l1", "l2", "l3"))
def _functional() -> Example:
    _seed()
    return Functional(), (torch.randn(3, 4),), {}


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))


@register("frozen", layers=("backbone", "backbone.0", "head"))
def _frozen() -> Example:
    _seed()
    model = Frozen()
    model.backbone.requires_grad_(False)
    return model, (torch.randn(3, 4),), {}


@register("bn_train", layers=("0", "1", "2"), mutates=True)
def _bn_train() -> Example:
    _seed()
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten())
    return model.train(), (torch.randn(4, 2, 5, 5),), {}


class BagOfWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 6, padding_idx=0)
        self.proj = nn.Linear(6, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.proj(self.emb(ids).mean(dim=1))


@register("embedding_int", layers=("emb", "proj"))
def _embedding_int() -> Example:
    _seed()
    return BagOfWords(), (torch.tensor([[1, 5, 0, 0], [7, 7, 3, 19]]),), {}


class MaybeAux(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, None]:
        return self.lin(x), None


class NoneInTuple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = MaybeAux()

    def forward(self, x: Tensor) -> Tensor:
        y, aux = self.block(x)
        assert aux is None
        return y.relu()


@register("none_in_tuple", layers=("block", "block.lin"), nested=("block",))
def _none_in_tuple() -> Example:
    _seed()
    return NoneInTuple(), (torch.randn(2, 4),), {}


class DeepNest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(
            {
                "enc": nn.ModuleList(
                    nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Sequential(nn.Linear(4, 4)))
                    for _ in range(2)
                ),
                "dec": nn.ModuleList([nn.Sequential(nn.Linear(4, 2))]),
            }
        )

    def forward(self, x: Tensor) -> Tensor:
        for blk in self.blocks["enc"]:
            x = blk(x)
        return self.blocks["dec"][0](x)


@register(
    "deep_nesting",
    layers=("blocks.enc.0.0", "blocks.enc.1.2.0", "blocks.dec.0.0"),
)
def _deep_nesting() -> Example:
    _seed()
    return DeepNest(), (torch.randn(2, 4),), {}


class Sub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.lin(x))


class DirectForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sub = Sub()
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.sub.forward(x))  # bypasses __call__: sub's hooks never fire


@register("direct_forward", layers=("sub", "sub.lin", "head"), not_run=("sub",))
def _direct_forward() -> Example:
    _seed()
    return DirectForward(), (torch.randn(2, 4),), {}


class Recursive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor, depth: int) -> Tensor:
        if depth == 0:
            return self.lin(x)
        return torch.tanh(self(x, depth - 1)) * 0.5 + self.lin(x)


class RecursiveModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rec = Recursive()

    def forward(self, x: Tensor) -> Tensor:
        return self.rec(x, 3)


@register("recursive", layers=("rec", "rec.lin"), reused={"rec": 4, "rec.lin": 4})
def _recursive() -> Example:
    _seed()
    return RecursiveModel(), (torch.randn(2, 4),), {}


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.la = nn.Linear(4, 4)
        self.lb = nn.Linear(4, 4)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.la(a) * torch.sigmoid(self.lb(b))


class SameTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.mix = Mix()

    def forward(self, x: Tensor) -> Tensor:
        h = self.pre(x)
        return self.mix(h, h)  # the same tensor as both inputs


@register("same_tensor_twice", layers=("pre", "mix", "mix.la"), aliased={"mix": (("a", "b"),)})
def _same_tensor_twice() -> Example:
    _seed()
    return SameTwice(), (torch.randn(2, 4),), {}


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.pre(x)
        return self.head(self.block(h) + h)  # h also flows around block


@register("residual_skip", layers=("pre", "block", "head"))
def _residual_skip() -> Example:
    _seed()
    return Skip(), (torch.randn(2, 4),), {}


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(
        self, x: Tensor, scale: float, mode: str = "sum", bias: Tensor | None = None
    ) -> Tensor:
        y = self.lin(x) * scale
        if bias is not None:
            y = y + bias
        return y if mode == "sum" else -y


class NonTensorArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scaled = Scaled()

    def forward(self, x: Tensor) -> Tensor:
        return self.scaled(x, 2.0, mode="neg")


@register("non_tensor_args", layers=("scaled", "scaled.lin"))
def _non_tensor_args() -> Example:
    _seed()
    return NonTensorArgs(), (torch.randn(2, 4),), {}


class TopK(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        values, indices = x.topk(2, dim=-1)
        return values, indices


class TopKModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.topk = TopK()

    def forward(self, x: Tensor) -> Tensor:
        values, indices = self.topk(self.lin(x))
        return values * (indices.float() + 1)


@register("int_output", layers=("lin", "topk"), nested=("topk",))
def _int_output() -> Example:
    _seed()
    return TopKModel(), (torch.randn(3, 4),), {}


class SharedAlias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.again = self.first  # one module, two attribute names

    def forward(self, x: Tensor) -> Tensor:
        return self.again(torch.tanh(self.first(x)))


@register("shared_alias", layers=("first",), reused={"first": 2})
def _shared_alias() -> Example:
    _seed()
    return SharedAlias(), (torch.randn(2, 4),), {}


class IdentityOut(nn.Module):
    """A block whose last layer returns its input object (nn.Identity), like HF ResNet."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ident = nn.Identity()
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ident(self.lin(x)))


@register("identity", layers=("lin", "ident", "head"))
def _identity() -> Example:
    _seed()
    return IdentityOut(), (torch.randn(2, 4),), {}


class ActsOnParentsTensor(nn.Module):
    """The parent relies on children changing its tensor in place: it ignores what
    ``self.scale_(h)`` and ``self.act(h)`` return and goes on with ``h`` itself, which it also
    adds to an identity of itself, then slices (a non-contiguous input for the head)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.act = nn.ReLU(inplace=True)
        self.scale_ = InPlaceScale()
        self.ident = nn.Identity()
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        self.scale_(h)
        self.act(h)
        h = self.ident(h) + h
        return self.head(h[:, ::2])


class InPlaceScale(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(3.0)


@register(
    "acts_on_parents_tensor",
    layers=("lin", "scale_", "act", "ident", "head"),
    inplace=("lin", "scale_"),
)
def _acts_on_parents_tensor() -> Example:
    _seed()
    return ActsOnParentsTensor(), (torch.randn(3, 4),), {}
