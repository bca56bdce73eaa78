"""hs.capture and hs.edit under tensor parallelism on two gloo processes, against the same
model unsharded in one process (the oracle): each record's layout (placements, mesh, global
shape; unknown where nothing says how a plain tensor lies), ``gather=True`` (the global
activation on every rank, one all-gather per sharded output, counted at the dispatcher),
``reduce=`` over the global tensor, ``DTensor`` outputs (``use_local_output=False``), and an
edit of a column-parallel q projection (each rank ablates the heads it holds).

One launch does every check (the start costs most of the time); it has a timeout and leaves no
process behind (``test_sharded._spawn``)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from test_sharded import _Collectives, _spawn
from test_sharded_tp import _MODELS, _batches, _Block, _make, _mesh, _parallelize, _slack

pytestmark = pytest.mark.slow  # (the models live in the ranks: nothing of the parent changes)

#: per model: its parallelized layers, and a layer after a column-parallel one whose plain
#: output says nothing of how it lies (a ReLU: a slice of the features on each rank)
_LAYERS = {"mlp": (["0", "2"], "1"), "block": (["q", "k", "v", "o", "fc1", "fc2"], "act")}
_GATHER = "_c10d_functional.all_gather_into_tensor.default"


def _base(kind: str) -> str:
    return kind.removesuffix("64").removesuffix("-dtensor")


def _oracle(kind: str, x: Tensor, layers: list[str]) -> dict[str, Tensor]:
    """The unsharded model's outputs of ``layers`` on ``x``, with plain torch hooks."""
    model = _make(kind)
    seen: dict[str, Tensor] = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, o, n=n: seen.__setitem__(n, o.detach().clone())
        )
        for n in layers
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _near(got: Tensor, want: Tensor, kind: str, where: Any) -> None:
    """Within 1e-6 relative; float32 row-parallel sums also within TP's order of sums
    (``test_sharded_tp._slack``) of the largest magnitude."""
    assert type(got) is Tensor and got.shape == want.shape, (where, type(got), got.shape)
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(
        got, want, rtol=1e-6, atol=_slack(kind) * scale, msg=lambda m: f"{where}: {m}"
    )


def _check_layouts(kind: str, mesh: Any, rank: int) -> None:
    """Records without gather: this rank's piece, and its layout read honestly."""
    from torch.distributed.tensor import Replicate, Shard

    layers, after = _LAYERS[_base(kind)]
    plan = _MODELS[_base(kind)][1]
    x = _batches(kind, 1)[0]
    want = _oracle(kind, x, [*layers, after])
    model = _parallelize(_make(kind), kind, mesh, "tp")
    with torch.no_grad(), hs.capture(model, [*layers, after]) as cap:
        model(x)
    for name in layers:
        call, whole = cap[name].last, want[name]
        col = plan[name] == "col"
        last = whole.dim() - 1
        assert call.placements == ((Shard(last),) if col else (Replicate(),)), (kind, name)
        assert call.mesh is mesh and call.global_shape == whole.shape, (kind, name)
        assert call.layout is not None and call.layout.source == "tp-layer"
        piece = whole.chunk(2, dim=-1)[rank] if col else whole
        _near(call.output, piece, kind, (kind, name))
    unknown = cap[after].last.layout
    assert unknown is not None and unknown.source == "unknown" and unknown.placements is None
    assert cap[after].last.global_shape is None and cap[after].last.mesh is None
    # a model without DTensor parameters: no layout at all
    plain = _make(kind)
    with torch.no_grad(), hs.capture(plain, layers[0], gather=True) as cap:
        plain(x)
    assert cap[layers[0]].last.layout is None and cap[layers[0]].last.placements is None


def _check_gather(kind: str, mesh: Any) -> None:
    """gather=True: every parallelized layer's global output on every rank; one all-gather
    per column-parallel layer's call (its slice), none for a row-parallel one (whole)."""
    layers, after = _LAYERS[_base(kind)]
    plan = _MODELS[_base(kind)][1]
    x = _batches(kind, 1)[0]
    want = _oracle(kind, x, layers)
    model = _parallelize(_make(kind), kind, mesh, "tp")
    with torch.no_grad(), _Collectives() as plain:
        model(x)
    with torch.no_grad(), _Collectives() as seen, hs.capture(model, layers, gather=True) as cap:
        model(x)
    for name in layers:
        _near(cap[name].output, want[name], kind, (kind, name, "gather"))
    added = Counter(seen.ops) - Counter(plain.ops)
    assert not Counter(plain.ops) - Counter(seen.ops), seen.ops
    columns = sum(1 for n in layers if plan[n] == "col")
    assert added == Counter({_GATHER: columns}), (kind, seen.ops)
    # a plain tensor nothing places: refused on every rank alike, naming it and the way out
    with pytest.raises(hs.UsageError, match=f"'{after}' output is a plain tensor"):
        with torch.no_grad(), hs.capture(model, after, gather=True):
            model(x)


def _check_reduce(kind: str, mesh: Any) -> None:
    """reduce= over the global tensor (a reduction over the sharded features differs from
    this rank's), with the collectives of gather=, none more."""
    layers, _ = _LAYERS[_base(kind)]
    x = _batches(kind, 1)[0]
    want = _oracle(kind, x, layers)
    model = _parallelize(_make(kind), kind, mesh, "tp")
    reducers: dict[str, Any] = {
        "batch_mean": lambda t: t.mean(0),
        "spatial_mean": lambda t: t.mean(tuple(range(2, t.dim()))) if t.dim() > 2 else t,
        "token_mean": lambda t: t.mean(1) if t.dim() > 2 else t,
    }
    norm = lambda t: t.norm()  # noqa: E731 - a function reduce=, over the whole tensor
    columns = sum(1 for n in layers if _MODELS[_base(kind)][1][n] == "col")
    with torch.no_grad(), _Collectives() as plain:
        model(x)
    for reduce, by_hand in [*reducers.items(), (norm, norm)]:
        with torch.no_grad(), _Collectives() as seen:
            with hs.capture(model, layers, reduce=reduce) as cap:
                model(x)
        for name in layers:
            got, exp = cap[name].output, by_hand(want[name])
            _near(got, exp, kind, (kind, name, reduce))
        added = Counter(seen.ops) - Counter(plain.ops)
        assert added == Counter({_GATHER: columns}), (kind, reduce, seen.ops)


def _check_dtensor(mesh: Any, rank: int) -> None:
    """DTensor outputs (use_local_output=False): the record keeps the DTensor, its layout
    its own; gather=True and reduce= give the global tensor and its reduction."""
    from torch.distributed.tensor import DTensor, Shard

    kind = "mlp-dtensor"
    x = _batches(kind, 1)[0]
    want = _oracle(kind, x, ["0", "1", "2"])
    model = _parallelize(_make(kind), kind, mesh, "tp")
    with torch.no_grad(), hs.capture(model, ["0", "1"]) as cap:
        model(x)
    for name in ("0", "1"):  # (the ReLU gets the DTensor and hands one on)
        call = cap[name].last
        assert isinstance(call.output, DTensor), (name, type(call.output))
        assert call.placements == (Shard(1),) and call.mesh is mesh
        assert call.global_shape == want[name].shape and call.layout.source == "dtensor"  # type: ignore[union-attr]
        _near(call.output.to_local(), want[name].chunk(2, dim=-1)[rank], kind, name)
    with torch.no_grad(), hs.capture(model, ["0", "1", "2"], gather=True) as cap:
        model(x)
    for name in ("0", "1", "2"):
        _near(cap[name].output, want[name], kind, (name, "gather"))
    with torch.no_grad(), hs.capture(model, ["0", "1"], reduce="batch_mean") as cap:
        model(x)
    for name in ("0", "1"):
        _near(cap[name].output, want[name].mean(0), kind, (name, "batch_mean"))
    # an edit of a DTensor output sees the DTensor (the whole tensor, as DTensor's operators
    # do): the same result as on the unsharded model
    oracle = _make(kind)
    edits = {"0": hs.scale(0.5), "1": hs.add(0.25)}
    with torch.no_grad(), hs.edit(oracle, edits):
        edited = oracle(x)
    with torch.no_grad(), hs.edit(model, edits):
        _near(model(x), edited, kind, "DTensor edit")
    # units narrow plain tensors: a DTensor output is refused with the ways out, not torch's
    # "mixed torch.Tensor and DTensor" from inside the narrowing
    for session in (
        lambda: hs.capture(model, "0", neurons=[0]),
        lambda: hs.edit(model, {"0": hs.ablate()}, neurons=[0]),
    ):
        with torch.no_grad(), pytest.raises(hs.UsageError, match="output is a DTensor"):
            with session():
                model(x)


def _check_rows_sharded(mesh: Any, rank: int) -> None:
    """A row-parallel layer whose plan shards its output by rows (``output_layouts=
    Shard(0)``, as sequence parallelism does): the piece is read as ``Shard(0)`` of the whole
    (from the layer's input and width, not assumed to be the features), and gathered whole."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    kind = "mlp"
    x = _batches(kind, 1)[0]
    want = _oracle(kind, x, ["2"])
    model = _make(kind)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Shard(0))}
    parallelize_module(model, mesh, plan)
    with torch.no_grad(), hs.capture(model, "2") as cap:
        model(x)
    call = cap["2"].last
    assert call.placements == (Shard(0),) and call.global_shape == want["2"].shape
    _near(call.output, want["2"].chunk(2)[rank], kind, "rows")
    with torch.no_grad(), hs.capture(model, "2", gather=True) as cap:
        model(x)
    _near(cap["2"].output, want["2"], kind, "rows gathered")


def _heads_block() -> nn.Module:
    torch.manual_seed(0)
    return _Block(d=16, head=4, hidden=12)  # 4 heads of 4: each rank holds 2


def _check_head_ablation(mesh: Any) -> None:
    """An edit of a column-parallel q projection applies to the rank's piece: ablating
    neurons 0-3 (local head 0) on every rank ablates global heads 0 and 2 (rank 0 holds
    heads 0-1, rank 1 heads 2-3), as the unsharded model with those heads ablated."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = _MODELS["block"][1]
    x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(3))
    oracle = _heads_block()
    with torch.no_grad(), hs.edit(oracle, {"q": hs.ablate()}, neurons=[0, 1, 2, 3, 8, 9, 10, 11]):
        want = oracle(x)
    from test_sharded_tp import _styles

    model = _heads_block()
    made = _styles("block")
    parallelize_module(model, mesh, {n: made[s]() for n, s in styles.items()})
    with torch.no_grad(), hs.edit(model, {"q": hs.ablate()}, neurons=[0, 1, 2, 3]) as ed:
        got = model(x)
    assert ed.applied["q"] == 1
    _near(got, want, "block", "head ablation")
    with torch.no_grad():
        assert not torch.allclose(model(x), want, atol=1e-3)  # (the edit changed something)


def _rank(rank: int, world: int, out: str) -> None:
    """One rank (a failure is written to ``out`` and ends the process at once: a peer may be
    waiting in a collective)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{out}/init",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        torch.set_num_threads(1)
        mesh = _mesh(world, "tp")
        for kind in ("mlp", "block", "mlp64"):
            _check_layouts(kind, mesh, rank)
            _check_gather(kind, mesh)
            _check_reduce(kind, mesh)
        _check_dtensor(mesh, rank)
        _check_rows_sharded(mesh, rank)
        _check_head_ablation(mesh)
        dist.destroy_process_group()
    except BaseException:
        import traceback

        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def test_tp_two_ranks_capture_gather_reduce_edit_like_unsharded(tmp_path: Path) -> None:
    _spawn(_rank, (2, str(tmp_path)), tmp_path, nprocs=2, seconds=240)
