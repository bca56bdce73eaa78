"""hs.clip_grad_norm on sharded gradients (DTensor): FSDP2 (``fully_shard``) on two gloo
processes, HSDP on a 2x2 mesh (four processes), and hand-placed DTensors (``Shard(1)``,
``Replicate``, ``Partial``), each against ``torch.nn.utils.clip_grad_norm_`` on the sharded
gradients and against the same model unsharded in one process on the same global batch.
Collectives are counted at the dispatcher, where every c10d and functional collective passes.
Every launch has a timeout and leaves no process behind; each does all its checks in one start
(the start costs most of the time)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs

pytestmark = pytest.mark.slow  # (the models live in the ranks: nothing of the parent changes)

#: (norm_type, max_norm, per_layer): clipped and not, the 1-, 2- and inf norms, per layer
_CASES = [
    (2.0, 0.05, False),
    (2.0, 1e6, False),
    (1.0, 0.05, False),
    (math.inf, 0.05, False),
    (2.0, 0.05, True),
]


def _mlp() -> nn.Module:
    # 5 rows over 2 ranks: pieces of 3 and 2; the last layer's single row leaves rank 1 an
    # empty piece of its weight and bias
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 1))


def _batch() -> Tensor:
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(1))


def _layer_grads(model: nn.Module) -> dict[str, list[Tensor]]:
    out: dict[str, list[Tensor]] = {}
    for name, p in model.named_parameters():
        out.setdefault(name.rsplit(".", 1)[0], []).append(p.grad)  # type: ignore[arg-type]
    return out


class _Collectives:
    """Every collective run inside ``with``, by operator name, counted at the dispatcher
    (ops of DTensors are let through first, so the collectives they turn into are counted
    too), and the ranks of the group of every ``torch.distributed.all_reduce``."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                from torch.distributed.tensor import DTensor

                if any(t is DTensor for t in types):
                    return NotImplemented  # DTensor first: its collectives come back here
                name = str(func)
                collective = name.split(".")[0] in ("c10d", "_c10d_functional", "c10d_functional")
                if collective and not any(a in name for a in ("wait_tensor", "_wrap_tensor")):
                    counter.ops.append(name)  # (waits and wrappers move no data)
                return func(*args, **(kwargs or {}))

        self.ops: list[str] = []
        self.groups: list[list[int]] = []
        self._mode = Mode()

    def __enter__(self) -> _Collectives:
        import torch.distributed as dist

        self._all_reduce = dist.all_reduce

        def all_reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group") or dist.group.WORLD
            self.groups.append(dist.get_process_group_ranks(group))
            return self._all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        self._mode.__exit__(*exc)
        dist.all_reduce = self._all_reduce


def _oracle(world: int) -> nn.Module:
    """The unsharded model after a backward on the whole batch in this one process: FSDP
    averages the ranks' gradients, each of its own slice's loss, so the loss is their mean."""
    model = _mlp()
    (model(_batch()).pow(2).sum() / world).backward()
    return model


def _check_clipping(model: nn.Module, shard_ranks: list[int], world: int) -> None:
    """hs.clip_grad_norm on the sharded ``model`` (its gradients after one backward): every
    case equal to torch's clip_grad_norm_ on the unsharded model and on the sharded one, one
    all-reduce over ``shard_ranks``."""
    oracle_model = _oracle(world)
    saved = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    want_grads = {n: p.grad.clone() for n, p in oracle_model.named_parameters()}

    def restore(m: nn.Module, grads: dict[str, Tensor]) -> None:
        for n, p in m.named_parameters():
            (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).copy_(grads[n])

    for norm_type, max_norm, per_layer in _CASES:
        case = f"{norm_type=} {max_norm=} {per_layer=}"
        restore(model, saved)
        restore(oracle_model, want_grads)
        # the oracle: torch on the unsharded model, layer by layer when per_layer
        layers = _layer_grads(oracle_model)
        layer_norms = {
            k: float(torch.nn.utils.get_total_norm(v, norm_type)) for k, v in layers.items()
        }
        groups = [list(m.parameters()) for m in oracle_model if list(m.parameters())]
        totals = [
            float(torch.nn.utils.clip_grad_norm_(g, max_norm, norm_type=norm_type))
            for g in (groups if per_layer else [list(oracle_model.parameters())])
        ]
        with _Collectives() as seen:
            report = hs.clip_grad_norm(model, max_norm, norm_type=norm_type, per_layer=per_layer)
        assert seen.ops == ["c10d.allreduce_.default"], (case, seen.ops)
        assert seen.groups == [shard_ranks], (case, seen.groups)
        assert report.layers == pytest.approx(layer_norms, rel=1e-6), case
        if per_layer:
            coefs = {k: min(1.0, max_norm / (v + 1e-6)) for k, v in layer_norms.items()}
        else:
            assert report.total_norm == pytest.approx(totals[0], rel=1e-6), case
            coefs = {k: min(1.0, max_norm / (totals[0] + 1e-6)) for k in layer_norms}
        assert report.clipped == pytest.approx({k: c for k, c in coefs.items() if c < 1}), case
        assert report.was_clipped == (max_norm < 1), case
        assert report.nonfinite == []
        # every rank's piece scaled by the global coefficient
        for n, p in model.named_parameters():
            torch.testing.assert_close(
                p.grad.to_local(), saved[n] * coefs[n.rsplit(".", 1)[0]], rtol=1e-6, atol=0
            )
        # and the whole gradients equal the unsharded model's clipped by torch
        full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        for n, p in oracle_model.named_parameters():
            torch.testing.assert_close(full[n], p.grad, rtol=1e-6, atol=1e-8)
        # torch on the sharded gradients: the same layer norms, total and clipped pieces
        # (not the inf norm: there torch's _foreach_norm refuses rank 1's empty piece of "4")
        if math.isinf(norm_type):
            continue
        mine = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        restore(model, saved)
        sharded = {
            k: float(torch.nn.utils.get_total_norm(v, norm_type).full_tensor())
            for k, v in _layer_grads(model).items()
        }
        assert report.layers == pytest.approx(sharded, rel=1e-6), case
        if not per_layer:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            assert report.total_norm == pytest.approx(float(total.full_tensor()), rel=1e-6)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad.to_local(), mine[n], rtol=1e-6, atol=0)
    restore(model, saved)


def _check_nonfinite(model: nn.Module, rank: int, shard_ranks: list[int]) -> None:
    """An Inf in the first shard rank's piece of one gradient, a NaN in the second's piece of
    another: found on every rank, the error names each parameter with its rank, and nothing is
    clipped anywhere; without the error, the norms are those of the whole gradients."""
    grads = {n: p.grad.to_local() for n, p in model.named_parameters()}
    if rank == shard_ranks[0]:
        grads["0.bias"][0] = math.inf
    if rank == shard_ranks[1]:
        grads["2.weight"][0, 0] = math.nan
    saved = {n: g.clone() for n, g in grads.items()}
    where = {"0.bias": [shard_ranks[0]], "2.weight": [shard_ranks[1]]}
    named = rf"0\.bias \(rank {shard_ranks[0]}\), 2\.weight \(rank {shard_ranks[1]}\)"
    with _Collectives() as seen, pytest.raises(hs.NonFiniteError, match=named) as info:
        hs.clip_grad_norm(model, 0.05, error_if_nonfinite=True)
    # the norms' all-reduce, and one more (only on the way to the error) that finds the ranks
    assert seen.ops == ["c10d.allreduce_.default"] * 2, seen.ops
    assert seen.groups == [shard_ranks] * 2
    assert info.value.module == "0.bias" and info.value.stats["ranks"] == where
    for n, g in grads.items():  # nothing clipped
        torch.testing.assert_close(g, saved[n], rtol=0, atol=0, equal_nan=True)
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for norm_type in (2.0, 1.0, math.inf):
        for n, g in grads.items():  # (a NaN total scales every gradient by NaN)
            g.copy_(saved[n])
        report = hs.clip_grad_norm(model, 1e6, norm_type=norm_type)
        want = {
            k: float(
                torch.nn.utils.get_total_norm(
                    [full[f"{k}.{w}"] for w in ("weight", "bias")], norm_type
                )
            )
            for k in ("0", "2", "4")
        }
        assert math.isinf(want["0"]) and math.isnan(want["2"])  # (the oracle sees them too)
        assert report.layers == pytest.approx(want, nan_ok=True, rel=1e-6), norm_type
        assert report.nonfinite == ["0.bias", "2.weight"] and math.isnan(report.total_norm)
    for n, g in grads.items():
        g.copy_(saved[n])
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
    assert math.isnan(float(total.full_tensor()))


def _fsdp_rank(rank: int, world: int, out: str, hsdp: bool) -> None:
    """One rank: FSDP2 (or HSDP) on the MLP, one backward on its slice of the batch, then
    the checks. A failure is written to ``out`` and ends the process at once: a peer may be
    waiting in a collective, and a clean exit would wait for it."""
    import torch.distributed as dist

    try:
        init = f"file://{out}/init"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        _fsdp_checks(rank, world, hsdp)
        dist.destroy_process_group()
    except BaseException:
        import traceback

        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)  # (see tests/test_monitoring.py::_ddp_rank: gloo's exit can hang under load)


def _fsdp_checks(rank: int, world: int, hsdp: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    if hsdp:  # 2 replicas x 2 shards: ranks (0, 1) and (2, 3) each hold a whole copy
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard_ranks = [rank - rank % 2, rank - rank % 2 + 1]
    else:
        mesh = init_device_mesh("cpu", (world,))
        shard_ranks = list(range(world))
    model = _mlp()
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = _batch().chunk(world)[rank]  # this rank's slice of the global batch
    model(x).pow(2).sum().backward()
    want = ("Replicate()", "Shard(dim=0)") if hsdp else ("Shard(dim=0)",)
    assert tuple(map(repr, model[0].weight.grad.placements)) == want
    _check_clipping(model, shard_ranks, world)
    if not hsdp:
        _check_placements(rank)
    _check_nonfinite(model, rank, shard_ranks)


def _check_placements(rank: int) -> None:
    """Hand-placed DTensor parameters: a gradient sharded along its columns (as a row-parallel
    TP weight), one replicated, one partial (each rank holds a term of the sum). Only the
    column-sharded one is combined; the partial one is summed first."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    gen = torch.Generator().manual_seed(2)
    full = {n: torch.randn(3, 5, generator=gen) for n in ("cols", "same", "terms")}
    grads = {n: torch.randn(3, 5, generator=gen) for n in full}
    placed = {"cols": [Shard(1)], "same": [Replicate()], "terms": [Replicate()]}
    params = {n: nn.Parameter(distribute_tensor(full[n], mesh, placed[n])) for n in full}
    for n in ("cols", "same"):
        params[n].grad = distribute_tensor(grads[n].clone(), mesh, placed[n])
    term = grads["terms"] * (0.25 if rank == 0 else 0.75)  # the terms add up to the gradient
    params["terms"].grad = DTensor.from_local(term, mesh, [Partial()])
    plain = {n: nn.Parameter(t.clone()) for n, t in full.items()}  # the oracle: torch, unsharded
    for n, p in plain.items():
        p.grad = grads[n].clone()
    total = torch.nn.utils.clip_grad_norm_(list(plain.values()), 0.5)
    with _Collectives() as seen:
        report = hs.clip_grad_norm(params, 0.5)
    # the partial gradient's sum (torch's redistribute), then the one packed all-reduce
    assert seen.ops == ["_c10d_functional.all_reduce.default", "c10d.allreduce_.default"], seen.ops
    assert report.total_norm == pytest.approx(float(total), rel=1e-6)
    assert report.layers == pytest.approx({n: float(g.norm()) for n, g in grads.items()})
    for n, p in params.items():
        got = p.grad.full_tensor() if n != "terms" else p.grad.redistribute(mesh, [Replicate()])
        torch.testing.assert_close(got.to_local() if n == "terms" else got, plain[n].grad)


def _spawn(fn: Any, args: tuple[Any, ...], out: Path, nprocs: int, seconds: float) -> None:
    """``nprocs`` processes running ``fn(rank, *args)``; all killed after ``seconds`` (a rank
    waiting for a peer that died would hang the run) or once one has failed, none outlives the
    call. A failure fails the test with the tracebacks the ranks wrote to ``out``."""
    mp = pytest.importorskip("torch.multiprocessing")
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    try:
        while not context.join(timeout=1, grace_period=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} gloo processes did not finish in {seconds:.0f} s")
    except mp.ProcessExitedException:
        errors = sorted(out.glob("rank*.err"))
        pytest.fail("\n".join(f"{e.stem}: {e.read_text()}" for e in errors) or "a rank died")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def test_fsdp2_two_ranks_clip_like_torch_unsharded(tmp_path: Path) -> None:
    _spawn(_fsdp_rank, (2, str(tmp_path), False), tmp_path, nprocs=2, seconds=120)


def test_hsdp_two_by_two_combines_over_the_shard_dimension_only(tmp_path: Path) -> None:
    _spawn(_fsdp_rank, (4, str(tmp_path), True), tmp_path, nprocs=4, seconds=180)
