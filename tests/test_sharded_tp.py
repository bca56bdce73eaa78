"""Tensor parallelism (``parallelize_module`` with column- and row-parallel layers) on two gloo
processes, and FSDP2 over the data-parallel dimension of a 2x2 mesh on top of it (four
processes): hs.clip_grad_norm, hs.Monitor and hs.nonfinite on an MLP and on a small
transformer block (attention with column-parallel q/k/v and a row-parallel output, an MLP
column then row), each against the same model unsharded in one process on the same global
batch, and the collectives each adds counted at the dispatcher (``test_sharded._Collectives``).
The block also under FSDP2 alone (two processes) and HSDP (a 2x2 mesh); test_sharded.py has
the MLP there.

Each launch does every check of both models in one start (the start costs most of the time),
has a timeout, and leaves no process behind (``test_sharded._spawn``)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from test_sharded import (
    _CASES,
    _Collectives,
    _hand_histogram,
    _Log,
    _monitor_added,
    _Sink,
    _spawn,
)

pytestmark = pytest.mark.slow  # (the models live in the ranks: nothing of the parent changes)


# -- the models, their plans, and the unsharded oracle -------------------------------------------


def _mlp() -> nn.Module:
    # 6 features split 3 + 3 by the column-parallel layer; its unit 1 (rank 0's) is dead, so a
    # dead fraction must put the two ranks' channels side by side (1 of 6), not add them up;
    # the last layer is left whole (replicated under TP, sharded by FSDP only)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias[1] = -100.0
    return model


class _Block(nn.Module):
    """A pre-norm transformer block: attention (q, k, v and the output projection) and an
    MLP, each behind a LayerNorm and a residual. The heads are counted from q's width, so
    under TP each rank runs its own heads."""

    def __init__(self, d: int = 8, head: int = 4, hidden: int = 12) -> None:
        super().__init__()
        self.head = head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # (no bias for k: softmax ignores it, so its gradient is 0 up to rounding noise)
        self.q, self.v, self.o = (nn.Linear(d, d) for _ in range(3))
        self.k = nn.Linear(d, d, bias=False)
        self.fc1, self.act, self.fc2 = nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, -1, self.head).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head), dim=-1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


def _block() -> nn.Module:
    torch.manual_seed(0)
    return _Block()


#: per model: how to make it, its TP plan (layer: "col" or "row"), the layers FSDP shards on
#: their own before the root, its ReLUs (dead units), one batch of every step
_MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, str], list[str], list[str]]] = {
    "mlp": (_mlp, {"0": "col", "2": "row"}, ["0", "2", "4"], ["1", "3"]),
    "block": (
        _block,
        {"q": "col", "k": "col", "v": "col", "o": "row", "fc1": "col", "fc2": "row"},
        [],
        ["act"],
    ),
}


#: the checks of each launch: both models in float32, where TP's order of sums shows in the
#: last bits (``_slack``), and the MLP in float64, where it does not
_KINDS = ("mlp", "block", "mlp64")


def _base(kind: str) -> str:
    return kind.removesuffix("64").removesuffix("-dtensor")


def _styles(kind: str) -> dict[str, Callable[[], Any]]:
    """The plan's styles; ``-dtensor``: a column-parallel layer hands on a ``DTensor``
    (``use_local_output=False``), and the layers after it get one."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    local = not kind.endswith("-dtensor")
    return {"col": lambda: ColwiseParallel(use_local_output=local), "row": RowwiseParallel}


def _dtype(kind: str) -> torch.dtype:
    return torch.float64 if kind.endswith("64") else torch.float32


def _slack(kind: str) -> float:
    """How far from the unsharded model's a value that sums many terms may be, relative to the
    largest magnitude among its kind: TP's row-parallel layers (and the backward of column-
    parallel ones) add partial products in another order than one process, so each value
    differs by the rounding of the terms it sums, and values that cancel (a mean, a small
    minimum) differ by that much, not by that much of themselves. float32: a few units in
    the 7th digit of the largest term; float64: nothing seen at 1e-6."""
    return 1e-5 if _dtype(kind) == torch.float32 else 0.0


def _make(kind: str) -> nn.Module:
    return _MODELS[_base(kind)][0]().to(_dtype(kind))


def _batches(kind: str, n: int) -> list[Tensor]:
    shape = (8, 3) if _base(kind) == "mlp" else (4, 3, 8)
    return [
        torch.randn(*shape, generator=torch.Generator().manual_seed(10 + k)).to(_dtype(kind))
        for k in range(n)
    ]


#: How each launch shards the models: "tp" (TP over 2 ranks), "fsdp+tp" (a 2x2 mesh: TP
#: within each pair, FSDP2 over the pairs), "fsdp" (FSDP2 over 2 ranks), "hsdp" (a 2x2 mesh:
#: FSDP2 shards within each pair, the pairs replicate)
_MODES = ("tp", "fsdp+tp", "fsdp", "hsdp")


def _sizes(mode: str, world: int) -> tuple[int, int]:
    """(data-parallel ranks, tensor-parallel ranks): each data-parallel rank runs its own
    slice of the global batch."""
    return {"tp": (1, world), "fsdp+tp": (2, 2), "fsdp": (world, 1), "hsdp": (world, 1)}[mode]


def _coords(mode: str, rank: int) -> tuple[int, int]:
    """(data-parallel rank, tensor-parallel rank) of ``rank``."""
    _, tp = _sizes(mode, 4)
    return rank // tp, rank % tp


def _parallelize(model: nn.Module, kind: str, mesh: Any, mode: str, prefix: str = "") -> nn.Module:
    """TP over the mesh's "tp" dimension, then FSDP2 over its "dp" dimension (HSDP: over
    the whole 2-D mesh); ``prefix``: where the model sits inside ``model``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    _, plan, own, _ = _MODELS[_base(kind)]
    styles = _styles(kind)
    if "tp" in mode:
        plan_ = {prefix + n: styles[s]() for n, s in plan.items()}
        parallelize_module(model, mesh["tp"], plan_)
    if mode != "tp":
        dp_mesh = mesh if mode == "hsdp" else mesh["dp"]
        for name in own:
            fully_shard(model.get_submodule(prefix + name), mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def _mesh(world: int, mode: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = {
        "tp": ((world,), ("tp",)),
        "fsdp+tp": ((2, 2), ("dp", "tp")),
        "fsdp": ((world,), ("dp",)),
        "hsdp": ((2, 2), ("replicate", "shard")),
    }[mode]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _oracle_backward(
    model: nn.Module, x: Tensor, dp: int, layers: list[str]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Forward and backward of the unsharded ``model`` on the whole batch ``x``, in the
    data-parallel ranks' slices (FSDP averages their gradients, each of its slice's loss):
    every watched layer's outputs and the gradients w.r.t. them, the slices put together."""
    acts: dict[str, list[Tensor]] = {}
    grads: dict[str, list[Tensor]] = {}

    def keep(o: Tensor, name: str) -> None:
        piece = len(acts.setdefault(name, []))
        acts[name].append(o.detach().clone())
        grads.setdefault(name, []).append(o)
        o.register_hook(lambda g: grads[name].__setitem__(piece, g.detach().clone()))

    hooks = [
        model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: keep(o, n))
        for n in layers
    ]
    try:
        loss = sum(model(piece).pow(2).sum() for piece in x.chunk(dp)) / dp
        loss.backward()  # type: ignore[union-attr]
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(a) for n, a in acts.items()}, {n: torch.cat(g) for n, g in grads.items()}


def _own_params(model: nn.Module) -> dict[str, list[str]]:
    """Per layer with parameters of its own, their full names."""
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():
        out.setdefault(name.rsplit(".", 1)[0], []).append(name)
    return out


def _watched(kind: str) -> list[str]:
    model = _make(kind)
    return [n for n, m in model.named_modules() if n and not list(m.children())]


def _oracle_steps(kind: str, dp: int, logged: set[int]) -> dict[int, dict[tuple[str, str], Any]]:
    """The unsharded model trained in this one process on the whole batches with the same
    optimizer: per logged step, every layer's statistics' inputs (activations and output
    gradients on the whole batch, parameters, gradients and updates whole)."""
    model = _make(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    layers = _watched(kind)
    out: dict[int, dict[tuple[str, str], Any]] = {}
    for k, x in enumerate(_batches(kind, 4)):
        acts, grads = _oracle_backward(model, x, dp, layers)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        pgrads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        if k not in logged:
            continue
        step: dict[tuple[str, str], Any] = {}
        for name in acts:
            step[name, "activation"] = acts[name]
            step[name, "gradient"] = grads[name] * dp  # (a rank's loss is not divided)
        now = {n: p.detach() for n, p in model.named_parameters()}
        for layer, ps in _own_params(model).items():
            norm = float(torch.cat([now[p].reshape(-1) for p in ps]).norm())
            update = float(torch.cat([(now[p] - before[p]).reshape(-1) for p in ps]).norm())
            g = torch.cat([pgrads[p].reshape(-1) for p in ps])
            step[layer, "parameter"] = {
                "norm": norm,
                "grad_norm": float(g.norm()),
                "grad_nonfinite": 0.0,
                "update_norm": update,
                "update_ratio": update / norm,
            }
            step[layer, "hist/parameter"] = _hand_histogram([now[p] for p in ps])
            step[layer, "hist/parameter_gradient"] = _hand_histogram([pgrads[p] for p in ps])
        out[k] = step
    return out


def _hand(t: Tensor, dead: bool) -> dict[str, float]:
    """The statistics of ``t`` by hand, with plain torch (channels: the last dim)."""
    v = t.double()
    out = {
        "norm": float(v.norm()),
        "mean": float(v.mean()),
        "std": float(v.std()),
        "min": float(v.min()),
        "max": float(v.max()),
        "zeros": float((t == 0).double().mean()),
        "nonfinite": 0,
    }
    if dead:  # a ReLU's channel is dead when it is 0 for every sample (and position)
        out["dead"] = float((t == 0).reshape(-1, t.shape[-1]).all(dim=0).double().mean())
    return out


def _local_view(t: Tensor, layer: str, kind: str, tp_rank: int, tp: int) -> Tensor:
    """What rank ``tp_rank`` of the tensor-parallel group holds of layer ``layer``'s whole
    output ``t``: its slice of the features after a column-parallel layer (and the ReLU
    after one), else all of it."""
    plan = _MODELS[_base(kind)][1]
    sliced = {n for n, s in plan.items() if s == "col"}
    if _base(kind) == "mlp":
        sliced |= {"1"}
    else:
        sliced |= {"act"}
    return t.chunk(tp, dim=-1)[tp_rank] if layer in sliced else t


# -- one launch: every check of both models ------------------------------------------------------


def _tp_rank(rank: int, world: int, out: str, mode: str) -> None:
    """One rank (a failure is written to ``out`` and ends the process at once: a peer may be
    waiting in a collective, and a clean exit would wait for it)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        init = f"file://{out}/init"
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60)
        )
        torch.set_num_threads(1)
        mesh = _mesh(world, mode)
        if "tp" in mode:  # (first: DTensor's sharding cache is cold)
            _check_summary(mesh, rank, world, mode)
        for kind in _KINDS if "tp" in mode else ("block",):  # (test_sharded.py: the MLP)
            _check_clipping(kind, mesh, rank, mode)
            for ranks in ("reduce", "each"):
                _check_monitor(kind, mesh, rank, world, mode, ranks)
            _check_tracer(kind, mesh, rank, world, mode)
        if mode == "tp":  # DTensor activations: measured on their pieces, by their placement
            for ranks in ("reduce", "each"):
                _check_monitor("mlp-dtensor", mesh, rank, world, mode, ranks)
        dist.destroy_process_group()
    except BaseException:
        import traceback

        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # (see tests/test_monitoring.py::_ddp_rank: gloo's exit can hang under load)


def _groups(mesh: Any, mode: str) -> list[list[int]]:
    """The process groups a sharded statistic combines over, in the order the plan meets
    them: FSDP's data-parallel dimension first (its placement comes first), then TP's;
    under HSDP the shard dimension alone, never the replicate one."""
    import torch.distributed as dist

    names = {"tp": ["tp"], "fsdp+tp": ["dp", "tp"], "fsdp": ["dp"], "hsdp": ["shard"]}[mode]
    return [dist.get_process_group_ranks(mesh[n].get_group()) for n in names]


def _piece(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _whole(t: Tensor) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check_clipping(kind: str, mesh: Any, rank: int, mode: str) -> None:
    """hs.clip_grad_norm after one backward: every case's report (total, per-layer norms,
    clip factors) and clipped gradients equal torch's clip_grad_norm_ on the unsharded model;
    one all-reduce per process group that shards a gradient."""
    dp, _ = _sizes(mode, torch.distributed.get_world_size())
    model = _parallelize(_make(kind), kind, mesh, mode)
    x = _batches(kind, 1)[0]
    dp_rank, _ = _coords(mode, rank)
    groups_ = _groups(mesh, mode)
    model(x.chunk(dp)[dp_rank]).pow(2).sum().backward()
    oracle = _make(kind)
    (sum(oracle(p).pow(2).sum() for p in x.chunk(dp)) / dp).backward()  # type: ignore[union-attr]
    saved = {n: _piece(p.grad).clone() for n, p in model.named_parameters()}  # type: ignore[arg-type]
    want = {n: p.grad.clone() for n, p in oracle.named_parameters()}  # type: ignore[union-attr]
    layers = _own_params(oracle)

    def restore(m: nn.Module, grads: dict[str, Tensor]) -> None:
        for n, p in m.named_parameters():
            _piece(p.grad).copy_(grads[n])  # type: ignore[arg-type]

    for norm_type, max_norm, per_layer in _CASES:
        case = f"{kind} {norm_type=} {max_norm=} {per_layer=}"
        restore(model, saved)
        restore(oracle, want)
        params = dict(oracle.named_parameters())
        layer_norms = {
            k: float(torch.nn.utils.get_total_norm([params[p].grad for p in ps], norm_type))  # type: ignore[misc]
            for k, ps in layers.items()
        }
        groups = [[params[p] for p in ps] for ps in layers.values()]
        totals = [
            float(torch.nn.utils.clip_grad_norm_(g, max_norm, norm_type=norm_type))
            for g in (groups if per_layer else [list(oracle.parameters())])
        ]
        with _Collectives() as seen:
            report = hs.clip_grad_norm(model, max_norm, norm_type=norm_type, per_layer=per_layer)
        assert seen.ops == ["c10d.allreduce_.default"] * len(groups_), (case, seen.ops)
        assert seen.groups == groups_, (case, seen.groups)
        assert report.layers == pytest.approx(layer_norms, rel=1e-6), case
        if per_layer:
            coefs = {k: min(1.0, max_norm / (v + 1e-6)) for k, v in layer_norms.items()}
        else:
            assert report.total_norm == pytest.approx(totals[0], rel=1e-6), case
            coefs = {k: min(1.0, max_norm / (totals[0] + 1e-6)) for k in layer_norms}
        assert report.clipped == pytest.approx({k: c for k, c in coefs.items() if c < 1}), case
        assert report.nonfinite == [], case
        for n, p in model.named_parameters():  # every piece scaled by the global factor
            coef = coefs[n.rsplit(".", 1)[0]]
            torch.testing.assert_close(_piece(p.grad), saved[n] * coef, rtol=1e-6, atol=0)  # type: ignore[arg-type]
            whole, oracle_grad = _whole(p.grad), params[n].grad  # type: ignore[arg-type]
            slack = _slack(kind) * float(oracle_grad.abs().max())
            torch.testing.assert_close(whole, oracle_grad, rtol=1e-6, atol=slack, msg=case)
    # a NaN in rank 1's piece of the first layer's weight gradient: named with its rank on
    # every rank, nothing clipped (the ranks: one all-reduce more per group, on the way).
    # HSDP: each replica's second rank (a replica's gradients are its own copy of them)
    restore(model, saved)
    first = "0.weight" if _base(kind) == "mlp" else "q.weight"  # (column-parallel: split)
    bad = groups_[0][1] if mode == "hsdp" else 1
    if rank == bad:
        _piece(dict(model.named_parameters())[first].grad).view(-1)[0] = math.nan  # type: ignore[arg-type]
    named = rf"\(rank {bad}\)"
    with _Collectives() as seen, pytest.raises(hs.NonFiniteError, match=named) as info:
        hs.clip_grad_norm(model, 0.05, error_if_nonfinite=True)
    assert info.value.module == first and info.value.stats["ranks"] == {first: [bad]}
    assert seen.ops == ["c10d.allreduce_.default"] * 2 * len(groups_), seen.ops
    if rank != bad:
        for n, p in model.named_parameters():
            torch.testing.assert_close(_piece(p.grad), saved[n], rtol=0, atol=0)  # type: ignore[arg-type]


def _check_monitor(kind: str, mesh: Any, rank: int, world: int, mode: str, ranks: str) -> None:
    """hs.Monitor(every=2, optimizer=) for three steps (0 and 2 logged): every record and
    parameter histogram equal to the hand statistics of the unsharded model on the whole
    batch (``ranks="each"``: activations and output gradients as this rank holds them), and
    the all-reduces each step adds, by group."""
    relus = _MODELS[_base(kind)][3]
    dp, tp = _sizes(mode, world)
    dp_rank, tp_rank = _coords(mode, rank)
    model = _parallelize(_make(kind), kind, mesh, mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batches = _batches(kind, 4)
    want = _oracle_steps(kind, dp, logged={1, 3})

    def train(x: Tensor) -> None:
        model(x.chunk(dp)[dp_rank]).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    with _Collectives() as plain:  # step 0 without the monitor: TP's and FSDP's own
        train(batches[0])
    sink = _AllSink()
    seen: list[_Collectives] = []
    with hs.Monitor(model, every=2, optimizer=opt, ranks=ranks, sinks=[sink]) as mon:  # type: ignore[arg-type]
        for x in batches[1:]:
            with _Collectives() as c:
                train(x)
            seen.append(c)
        with _Collectives() as closing:
            mon.close()
    added = _monitor_added(plain, seen, closing)  # (all started async, waited later)
    every = tuple(range(world))
    # one packed sum per group at the step's end: TP alone or FSDP2 alone, over the world;
    # HSDP, over the shard pair (never the replicate pair); FSDP2+TP, over the data-parallel
    # group (the pieces TP replicates, such as a row-parallel bias) and over the world (those
    # split over both dimensions). Those over the world join the world's reduction at k + 1
    # under "reduce": one all-reduce, there.
    groups = [tuple(g) for g in _groups(mesh, mode)]
    mine = Counter({groups[0]: 1, every: 1}) if mode == "fsdp+tp" else Counter({groups[0]: 1})
    logged = mine if ranks == "each" else mine - Counter({every: 1})
    read = Counter() if ranks == "each" else Counter({every: 1})
    assert added == [logged, read, logged, read], (kind, ranks, added)
    records = mon.records
    _check_records(records, want, kind, relus, ranks, dp, dp_rank, tp, tp_rank)
    if ranks == "reduce" and rank > 0:
        assert sink.records == [] and sink.hists == {}  # rank 0 writes
        return
    assert sink.records == records
    for k in (0, 2):
        for layer in _own_params(_make(kind)):
            for hist in ("parameter", "parameter_gradient"):
                stats, counts = sink.hists[f"{layer}/{hist}", k]
                w_stats, w_counts = want[k + 1][layer, f"hist/{hist}"]
                _same_histogram(stats, w_stats, _slack(kind), (kind, k, layer, hist))
                assert counts == w_counts, (kind, k, layer, hist)
        # activations and output gradients (one buffer with the rest: no collective more)
        for layer in _watched(kind):
            for hist in ("activation", "gradient"):
                t = want[k + 1][layer, hist]
                if ranks == "each":
                    t = _local_view(t.chunk(dp)[dp_rank], layer, kind, tp_rank, tp)
                stats, counts = sink.hists[f"{layer}/{hist}", k]
                w_stats, w_counts = _hand_histogram([t])
                _same_histogram(stats, w_stats, _slack(kind), (kind, k, layer, hist))
                assert _near_buckets(counts, w_counts, _slack(kind)), (kind, k, layer, hist)


class _AllSink(_Sink):
    """A sink that draws histograms of activations and output gradients too."""

    histograms = "all"


def _near_buckets(got: list[float], want: list[float], slack: float) -> bool:
    """The same bucket counts; with ``slack`` (float32 under TP: its order of sums), as many
    values in all, each bucket's count off by at most 1 and within one bucket of where the
    unsharded model's value fell (a value on a bucket's edge may fall on either side)."""
    if not slack or got == want:
        return got == want
    moved = [g - w for g, w in zip(got, want, strict=True)]
    return sum(moved) == 0 and all(abs(m) <= 1 for m in moved)


def _same_histogram(
    got: dict[str, float], want: dict[str, float], slack: float, where: Any
) -> None:
    """A histogram's statistics: the sum, minimum and maximum within ``slack`` of the largest
    magnitude for each value summed (see :func:`_slack`), the rest within 1e-6 relative."""
    got, want = dict(got), dict(want)
    scale = max(abs(want["min"]), abs(want["max"]))
    summed = slack * scale * want["num"]
    assert got.pop("sum") == pytest.approx(want.pop("sum"), rel=1e-6, abs=summed), where
    for key in ("min", "max"):
        got_, want_ = got.pop(key), want.pop(key)
        assert got_ == pytest.approx(want_, rel=1e-6, abs=slack * scale), (where, key)
    assert got == pytest.approx(want, rel=1e-6), where


def _check_records(
    records: list[dict[str, Any]],
    want: Any,
    kind: str,
    relus: list[str],
    ranks: str,
    dp: int,
    dp_rank: int,
    tp: int,
    tp_rank: int,
) -> None:
    assert sorted({r["step"] for r in records}) == [0, 2]
    for r in records:
        step = want[r["step"] + 1]
        stats = {k: v for k, v in r.items() if k not in ("step", "layer", "kind", "rank")}
        where = (kind, ranks, r["step"], r["layer"], r["kind"])
        if r["kind"] == "parameter":
            expected = dict(step[r["layer"], "parameter"])
            # an update (weights after minus before, nearly equal) magnifies the float32
            # rounding TP's order of sums leaves in the gradients by |w| / |dw| (_slack)
            for key in ("update_norm", "update_ratio"):
                near = max(_slack(kind), 1e-6)
                assert stats.pop(key) == pytest.approx(expected.pop(key), rel=near), where
            assert stats == pytest.approx(expected, rel=1e-6), (where, stats, expected)
            continue
        t = step[r["layer"], r["kind"]]
        if ranks == "each":  # this rank's slice of the batch, and of the features if sliced
            t = _local_view(t.chunk(dp)[dp_rank], r["layer"], kind, tp_rank, tp)
        expected = _hand(t, dead=r["kind"] == "activation" and r["layer"] in relus)
        # the mean and std of values that cancel lose relative precision in the Monitor's
        # sums, sharded or not: within 1e-6 of the RMS (test_sharded._check_records); and
        # the unsharded model's values differ by TP's order of sums (_slack)
        rms = expected["norm"] / math.sqrt(t.numel())
        slack = _slack(kind) * float(t.abs().max())
        for key in ("mean", "std", "min", "max"):
            got, exp = stats.pop(key), expected.pop(key)
            near = max(slack, 1e-6 * rms if key in ("mean", "std") else 0.0)
            assert got == pytest.approx(exp, rel=1e-6, abs=near), (where, key, got, exp)
        assert stats == pytest.approx(expected, rel=1e-6), (where, stats, expected)
    if (
        _base(kind) == "mlp" and ranks == "reduce"
    ):  # unit 1 of 6 dead: the ranks' channels side by side
        dead = [r["dead"] for r in records if r["layer"] == "1" and r["kind"] == "activation"]
        assert dead == pytest.approx([1 / 6, 1 / 6]), dead
    layers = _watched(kind)
    kinds = {(r["layer"], r["kind"]) for r in records if r["step"] == 0}
    assert kinds == {(n, k) for n in layers for k in ("activation", "gradient")} | {
        (n, "parameter") for n in _own_params(_make(kind))
    }


def _check_tracer(kind: str, mesh: Any, rank: int, world: int, mode: str) -> None:
    """hs.nonfinite on the model behind a ``log``: a clean step adds one all-reduce over the
    world per check (forward, backward); then a negative input on rank 1 only (its ``log`` is
    the first NaN; the row-parallel layer's all-reduce carries NaN to rank 1's TP peer, later
    in the forward) is named on every rank: rank 1, the step, layer "0", ``aten.log``."""
    dp, _ = _sizes(mode, world)
    dp_rank, _ = _coords(mode, rank)
    model = _parallelize(nn.Sequential(_Log(), _make(kind)), kind, mesh, mode, prefix="1.")
    x = _batches(kind, 1)[0].abs().add(0.1).chunk(dp)[dp_rank]  # positive: log is finite

    def step(x: Tensor) -> None:
        model(x).pow(2).sum().backward()

    with _Collectives() as plain:
        step(x)
    with _Collectives() as traced, hs.nonfinite(model) as report:
        step(x)
    assert report.ok and (report.forwards, report.backwards) == (1, 1)
    added = Counter(traced.ops) - Counter(plain.ops)
    assert not Counter(plain.ops) - Counter(traced.ops), traced.ops
    assert added == Counter({"c10d.allreduce_.default": 2}), traced.ops
    groups = Counter(map(tuple, traced.groups)) - Counter(map(tuple, plain.groups))
    assert groups == Counter({tuple(range(world)): 2}), traced.groups
    bad = x.clone()
    if rank == 1:
        bad.view(-1)[2] = -1.0  # only rank 1's input: log(-1) is NaN
    with hs.nonfinite(model) as report, pytest.raises(hs.NonFiniteError) as info:
        step(x)  # a clean step first: the finding is at step 2
        step(bad)
    error = info.value
    assert (error.rank, error.step, error.phase) == (1, 2, "forward"), str(error)
    assert (error.module, error.call, error.op) == ("0", 1, "aten.log"), str(error)
    assert "on rank 1 (forward 2)" in str(error), str(error)
    assert error.stats["inputs"]["min"] == -1.0 and error.stats["outputs"]["nan"] == 1
    # a backward: rank 1's loss is infinite; the column-parallel layers' all-reduces carry
    # it into its peer's gradients, where it arrives later in the backward: rank 1's <loss>
    model.zero_grad(set_to_none=True)
    with hs.nonfinite(model) as report, pytest.raises(hs.NonFiniteError) as info:
        (model(x).pow(2).sum() * (math.inf if rank == 1 else 1.0)).backward()
    error = info.value
    where = (error.rank, error.step, error.phase, error.module)
    assert where == (1, 1, "backward", "<loss>"), where
    assert report.findings == [error]
    model.zero_grad(set_to_none=True)


def test_tp_two_ranks_clip_monitor_nonfinite_like_unsharded(tmp_path: Path) -> None:
    _spawn(_tp_rank, (2, str(tmp_path), "tp"), tmp_path, nprocs=2, seconds=240)


def test_fsdp2_tp_two_by_two_clip_monitor_nonfinite_like_unsharded(tmp_path: Path) -> None:
    _spawn(_tp_rank, (4, str(tmp_path), "fsdp+tp"), tmp_path, nprocs=4, seconds=360)


def test_fsdp2_two_ranks_transformer_block_like_unsharded(tmp_path: Path) -> None:
    """The block under FSDP2 alone (test_sharded.py: the MLP)."""
    _spawn(_tp_rank, (2, str(tmp_path), "fsdp"), tmp_path, nprocs=2, seconds=240)


def test_hsdp_two_by_two_transformer_block_like_unsharded(tmp_path: Path) -> None:
    """The block under HSDP: shards within each pair, combined over the pair alone."""
    _spawn(_tp_rank, (4, str(tmp_path), "hsdp"), tmp_path, nprocs=4, seconds=360)


#: the MLP's parameters each rank holds, counted by hand from the plan. TP: "0" column-parallel
#: (rows 6 -> 3 + 3, and its bias), "2" row-parallel (columns 6 -> 3 + 3; its bias whole on
#: both), "4" whole on both: 3*3 + 3 + 4*3 + 4 + 4 + 1. FSDP2+TP: FSDP splits each TP piece's
#: rows over the data-parallel pair (3 -> 2 + 1, 4 -> 2 + 2, 1 -> 1 + 0): data-parallel rank
#: 0 holds 2*3 + 2 + 2*3 + 2 + 1*4 + 1, rank 1 1*3 + 1 + 2*3 + 2 + 0 + 0
_HELD = {"tp": [33, 33], "fsdp+tp": [21, 12]}


def _check_summary(mesh: Any, rank: int, world: int, mode: str) -> None:
    """hs.summary of the sharded MLP on this rank's batch: parameters of the whole model (57)
    and those this rank holds (:data:`_HELD`); FLOPs of the matrix products this rank ran (its
    share of each parallel layer, all of the layer left whole: 2 x batch x in x out each) and
    of all ranks together, against counts by hand."""
    model = _parallelize(_make("mlp"), "mlp", mesh, mode)
    dp, _ = _sizes(mode, world)
    dp_rank, _ = _coords(mode, rank)
    x = _batches("mlp", 1)[0].chunk(dp)[dp_rank]
    s = hs.summary(model, x)
    assert s.total_params == 6 * 3 + 6 + 4 * 6 + 4 + 4 + 1 == 57
    held = _HELD[mode][dp_rank]
    where = (s.world_size, s.global_rank, s.rank_params, s.rank_param_bytes)
    assert where == (world, rank, held, 4 * held)
    n = x.shape[0]
    mine = {"0": 2 * n * 3 * 3, "2": 2 * n * 3 * 4, "4": 2 * n * 4 * 1}
    assert {r.name: r.flops for r in s.rows if r.name in mine} == mine
    assert s.total_flops == sum(mine.values())
    assert s.world_flops == world * sum(mine.values())  # (every rank's share is the same)
    text = str(s)
    assert f"Params on rank {rank} of {world}: {held} ({4 * held} B)" in text, text
    assert f"FLOPs on all {world} ranks: {world * sum(mine.values())}" in text, text
    assert hs.Summary.from_json(s.to_json()) == s


# -- the guide's script ------------------------------------------------------------------------

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "sharded.md"


def _guide_script() -> str:
    """The python block of the "Sharded training" guide marked to run on two ranks."""
    _, marked = GUIDE.read_text().split("<!-- run: 2 ranks", 1)
    return marked.split("```python\n", 1)[1].split("\n```", 1)[0]


def _script_rank(rank: int, world: int, out: str, port: int, script: str) -> None:
    """One rank running ``script`` as ``torchrun --nproc_per_node=<world>`` would start it:
    the same environment variables (``env://``), in ``out``, its output in ``rank<r>.out``."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.chdir(out)
    try:
        torch.set_num_threads(1)
        with open(f"rank{rank}.out", "w") as log, contextlib.redirect_stdout(log):
            exec(compile(script, str(GUIDE), "exec"), {"__name__": "__main__"})
    except BaseException:
        import traceback

        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sharded_guide_script_runs_on_two_ranks(tmp_path: Path) -> None:
    """The guide's script, on two gloo processes started as torchrun starts them: rank 0
    prints the summary per rank and the last clip report and writes every logged step's
    records; rank 1 prints and writes nothing."""
    args = (2, str(tmp_path), _free_port(), _guide_script())
    _spawn(_script_rank, args, tmp_path, nprocs=2, seconds=180)
    printed = (tmp_path / "rank0.out").read_text()
    # by hand: "0" 32 of 64 rows (and their bias), "2" 32 of 64 columns and its whole bias,
    # "4" whole: 32*16 + 32 + 16*32 + 16 + 16 + 1 = 1,089 float32s; FLOPs 2*32 x (16*32 +
    # 32*16 + 16*1) on each rank; the operators TP's and FSDP's collectives run: not listed
    assert "Params on rank 0 of 2: 1,089 (4.254 KiB)" in printed, printed
    assert "FLOPs on rank 0: 66,560 (66.6 K)" in printed, printed
    assert "FLOPs on all 2 ranks: 133,120 (133 K)" in printed, printed
    assert "all_reduce" not in printed and "wait_tensor" not in printed, printed
    assert "last step: total gradient norm" in printed, printed
    # layer 0 (column-parallel, 64 features): rank 0 held 32, kept the whole batch's 64
    assert "layer 0: (Shard(dim=1),) of (32, 64), kept (32, 64)" in printed, printed
    assert (tmp_path / "rank1.out").read_text() == ""
    records = [json.loads(line) for line in (tmp_path / "monitor.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == [0, 10, 20]
    kinds = {(r["layer"], r["kind"]) for r in records if r["step"] == 0}
    layers = [str(i) for i in range(5)]
    assert kinds == {(n, k) for n in layers for k in ("activation", "gradient")} | {
        ("0", "parameter"),
        ("2", "parameter"),
        ("4", "parameter"),
        ("loss", "scalar"),
        ("grad_norm", "scalar"),
    }
    assert all(math.isfinite(r["norm"]) for r in records if "norm" in r)
