"""hs.clip_grad_norm on sharded gradients (DTensor): FSDP2 (``fully_shard``) on two gloo
processes, HSDP on a 2x2 mesh (four processes), and hand-placed DTensors (``Shard(1)``,
``Replicate``, ``Partial``), each against ``torch.nn.utils.clip_grad_norm_`` on the sharded
gradients and against the same model unsharded in one process on the same global batch.
Collectives are counted at the dispatcher, where every c10d and functional collective passes.
Then hs.Monitor on the same FSDP2 and HSDP models, every record and parameter histogram
against statistics computed by hand on the unsharded model.
Every launch has a timeout and leaves no process behind; each does all its checks in one start
(the start costs most of the time)."""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
import zygote

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


class _Work:
    """The ``Work`` of an ``all_reduce(async_op=True)``, its ``wait`` calls seen: which
    ``_Collectives`` block was open then."""

    def __init__(self, work: Any) -> None:
        self._work = work
        self.waited_in: list[_Collectives | None] = []

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.waited_in.append(_Collectives.current)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Collectives:
    """Every collective run inside ``with``, by operator name, counted at the dispatcher
    (ops of DTensors are let through first, so the collectives they turn into are counted
    too), the ranks of the group of every ``torch.distributed.all_reduce``, and the works
    of those started with ``async_op=True`` (``started``), their waits seen (:class:`_Work`)."""

    current: _Collectives | None = None  # the block open now

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
        self.started: list[_Work] = []
        self._mode = Mode()

    def __enter__(self) -> _Collectives:
        import torch.distributed as dist

        self._all_reduce = dist.all_reduce
        self._outer, _Collectives.current = _Collectives.current, self

        def all_reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group") or dist.group.WORLD
            self.groups.append(dist.get_process_group_ranks(group))
            work = self._all_reduce(tensor, *args, **kwargs)
            if not kwargs.get("async_op"):
                return work
            self.started.append(_Work(work))
            return self.started[-1]

        dist.all_reduce = all_reduce
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        self._mode.__exit__(*exc)
        dist.all_reduce = self._all_reduce
        _Collectives.current = self._outer


def _monitor_added(
    plain: _Collectives, steps: list[_Collectives], closing: _Collectives
) -> list[Counter[tuple[int, ...]]]:
    """The all-reduces the Monitor added in each step (and at ``close``), by group, beside
    the model's own (``plain``: one step without the monitor), checked to be all it adds;
    and every one of them started with ``async_op=True`` and waited exactly once, later than
    the step that started it (a later step, or ``close``): no step waits for its own."""
    fsdp, fsdp_groups = Counter(plain.ops), Counter(map(tuple, plain.groups))
    added = []
    for c in [*steps, closing]:
        base, base_groups = (fsdp, fsdp_groups) if c is not closing else (Counter(), Counter())
        ops = Counter(c.ops)
        assert not base - ops, c.ops
        assert set(ops - base) <= {"c10d.allreduce_.default"}, c.ops
        groups = Counter(map(tuple, c.groups)) - base_groups
        assert sum(groups.values()) == (ops - base)["c10d.allreduce_.default"], c.ops
        assert len(c.started) == sum(groups.values()), (c.ops, c.started)  # all async
        added.append(groups)
    order = [*steps, closing]
    for i, c in enumerate(order):
        for work in c.started:
            assert len(work.waited_in) == 1, work.waited_in  # waited, once
            waited = work.waited_in[0]
            assert waited in order, waited
            later = order.index(waited) > i  # type: ignore[arg-type]
            assert later or c is closing, (i, order.index(waited))  # type: ignore[arg-type]
    return added


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
    zygote.context()  # forked from a server that imported torch once (see zygote.py)
    context = mp.start_processes(
        fn, args=args, nprocs=nprocs, join=False, start_method=zygote.START_METHOD
    )
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


# -- hs.Monitor under FSDP2 --------------------------------------------------------------------


class _Sink:
    """A sink that keeps what it is given, parameter histograms included."""

    histograms = True

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.hists: dict[tuple[str, int], tuple[dict[str, float], list[float]]] = {}

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def histogram(self, tag: str, step: int, stats: Any, counts: Any, edges: Any) -> None:
        self.hists[tag, step] = (dict(stats), list(counts))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _steps_batches() -> list[Tensor]:
    return [torch.randn(8, 3, generator=torch.Generator().manual_seed(10 + k)) for k in range(4)]


def _hand(t: Tensor, dead: bool) -> dict[str, float]:
    """The statistics of ``t`` by hand, with plain torch: what a record reports."""
    finite = t[torch.isfinite(t)].double()  # (the exact statistics of the float32 values)
    out = {
        "norm": float(finite.norm()),
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "min": float(finite.min()),
        "max": float(finite.max()),
        "zeros": float((t == 0).double().mean()),
        "nonfinite": int((~torch.isfinite(t)).sum()),
    }
    if dead:  # a ReLU's channel (last dim) is dead when it is 0 for every sample
        out["dead"] = float((t == 0).all(dim=0).double().mean())
    return out


def _hand_histogram(ts: list[Tensor]) -> tuple[dict[str, float], list[float]]:
    from hookscope.diagnose._stats import EDGES

    every = torch.cat([t.reshape(-1) for t in ts]).double()
    v = every[torch.isfinite(every)]  # (NaN and Inf: counted in no bucket, and 0 in min/max)
    bucket = (v[:, None] > EDGES[None, :]).sum(1)  # buckets (EDGES[i-1], EDGES[i]]
    counts = torch.bincount(bucket, minlength=len(EDGES) + 1).double()
    zeroed = torch.nan_to_num(every, nan=0.0, posinf=0.0, neginf=0.0)
    stats = {
        "num": v.numel(),
        "sum": float(v.sum()),
        "sum_squares": float(v.square().sum()),
        "min": float(zeroed.min()),
        "max": float(zeroed.max()),
    }
    return stats, counts.tolist()


def _recorded_backward(
    model: nn.Module, x: Tensor, world: int
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Forward and backward of the unsharded ``model`` on the whole batch ``x``, in the ranks'
    slices (the same shapes, so the same float operations as each rank's forward; FSDP
    averages the ranks' gradients, each of its slice's loss): every layer's outputs and the
    gradients w.r.t. them, the slices put back together."""
    acts: dict[str, list[Tensor]] = {}
    grads: dict[str, list[Tensor]] = {}

    def keep(o: Tensor, name: str) -> None:
        piece = len(acts.setdefault(name, []))
        acts[name].append(o.detach().clone())
        grads.setdefault(name, []).append(o)  # (replaced by its gradient in backward)
        o.register_hook(lambda g: grads[name].__setitem__(piece, g.detach().clone()))

    hooks = [
        m.register_forward_hook(lambda m, a, o, n=str(i): keep(o, n)) for i, m in enumerate(model)
    ]
    try:
        loss = sum(model(piece).pow(2).sum() for piece in x.chunk(world)) / world
        loss.backward()  # type: ignore[union-attr]
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(a) for n, a in acts.items()}, {n: torch.cat(g) for n, g in grads.items()}


def _oracle_steps(
    world: int, logged: set[int], nan_at: int
) -> dict[int, dict[tuple[str, str], Any]]:
    """The unsharded MLP trained in this one process on the whole batches with the same
    optimizer: per logged step, every layer's statistics computed by hand (activations and
    output gradients on the whole batch, parameters, gradients and updates whole). At step
    ``nan_at`` the gradient of ``0.weight`` gets a NaN at row 3 (on rank 1's piece)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict[int, dict[tuple[str, str], Any]] = {}
    for k, x in enumerate(_steps_batches()):
        acts, grads = _recorded_backward(model, x, world)
        if k == nan_at:
            model[0].weight.grad[3, 0] = math.nan  # type: ignore[index]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        pgrads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        if k not in logged:
            continue
        step: dict[tuple[str, str], Any] = {}
        for name in acts:
            step[name, "activation"] = acts[name]
            step[name, "gradient"] = grads[name] * world  # (a rank's loss is not divided)
        for i in (0, 2, 4):
            ps = [f"{i}.weight", f"{i}.bias"]
            now = {n: p.detach() for n, p in model.named_parameters()}
            norm = float(torch.cat([now[p].reshape(-1) for p in ps]).norm())
            update = float(torch.cat([(now[p] - before[p]).reshape(-1) for p in ps]).norm())
            g = torch.cat([pgrads[p].reshape(-1) for p in ps])
            step[str(i), "parameter"] = {
                "norm": norm,
                "grad_norm": float(g.norm()),
                "grad_nonfinite": float((~torch.isfinite(g)).sum()),
                "update_norm": update,
                "update_ratio": update / norm,
            }
            step[str(i), "hist/parameter"] = _hand_histogram([now[p] for p in ps])
            step[str(i), "hist/parameter_gradient"] = _hand_histogram([pgrads[p] for p in ps])
        out[k] = step
    return out


def _monitor_rank(rank: int, world: int, out: str, hsdp: bool) -> None:
    """One rank of the Monitor test (see :func:`_fsdp_rank` for the failure handling)."""
    import torch.distributed as dist

    try:
        init = f"file://{out}/init"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        torch.set_num_threads(1)
        for ranks in ("reduce", "each"):
            _check_monitor(rank, world, ranks, hsdp)
            if not hsdp:
                _check_raise_mid_step(rank, world, ranks)
        if not hsdp:
            _check_made_before_sharding(rank, world)
        dist.destroy_process_group()
    except BaseException:
        import traceback

        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _check_monitor(rank: int, world: int, ranks: Any, hsdp: bool) -> None:
    """hs.Monitor(every=2, optimizer=) on the FSDP2 (or HSDP) MLP for four steps (0 and 2
    logged): every record and parameter histogram equal to the hand statistics of the
    unsharded model on the whole batch (``ranks="each"``: activations and output gradients of
    this rank's slice, parameters whole), and the all-reduces each step adds counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hsdp:  # 2 replicas x 2 shards: ranks (0, 1) and (2, 3) each hold a whole copy
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard = (rank - rank % 2, rank - rank % 2 + 1)
    else:
        mesh = init_device_mesh("cpu", (world,))
        shard = tuple(range(world))
    model = _mlp()
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batches = _steps_batches()
    # the monitor's steps 0 and 2; at step 2 a NaN in rank 1's piece of a gradient (HSDP: in
    # both replicas' rank that holds rows 3 and 4): counted once, in the whole tensor
    want = _oracle_steps(world, logged={1, 3}, nan_at=3)

    def train(x: Tensor, nan: bool = False) -> None:
        model(x.chunk(world)[rank]).pow(2).sum().backward()
        if nan and rank % 2 == 1:
            model[0].weight.grad.to_local()[0, 0] = math.nan  # (row 3 of 5: pieces of 3, 2)
        opt.step()
        opt.zero_grad()

    with _Collectives() as plain:  # step 0 without the monitor: FSDP's own collectives
        train(batches[0])
    sink = _Sink()
    seen: list[_Collectives] = []
    mon = hs.Monitor(model, every=2, optimizer=opt, ranks=ranks, sinks=[sink])
    with mon:
        for k, x in enumerate(batches[1:]):
            with _Collectives() as c:
                train(x, nan=k == 2)
            seen.append(c)
        with _Collectives() as closing:
            mon.close()
    # FSDP's collectives unchanged; what the monitor adds: one all-reduce per group, by group
    added = _monitor_added(plain, seen, closing)
    every = tuple(range(world))
    if ranks == "each":  # one packed sum (histograms' extremes in it), at the step's end
        assert added == [Counter({shard: 1}), Counter(), Counter({shard: 1}), Counter()], added
    elif not hsdp:  # step k's pieces join the DDP reduction at k + 1
        assert added == [Counter(), Counter({every: 1}), Counter(), Counter({every: 1})], added
    else:  # the shard group's at the step's end, the world's (DDP's) at k + 1
        reduced = Counter({every: 1})
        assert added == [Counter({shard: 1}), reduced, Counter({shard: 1}), reduced], added
    records = mon.records
    _check_records(records, want, rank, world, ranks)
    if ranks == "reduce" and rank > 0:
        assert sink.records == [] and sink.hists == {}  # rank 0 writes
        return
    assert sink.records == records
    for k in (0, 2):
        for i in ("0", "2", "4"):
            for kind in ("parameter", "parameter_gradient"):
                stats, counts = sink.hists[f"{i}/{kind}", k]
                w_stats, w_counts = want[k + 1][i, f"hist/{kind}"]
                assert stats == pytest.approx(w_stats, rel=1e-6), (k, i, kind)
                if k == 2 and i == "0":  # the NaN (then in the weight too): not a value
                    assert stats["num"] == 5 * 3 + 5 - 1
                assert counts == w_counts, (k, i, kind)


def _check_made_before_sharding(rank: int, world: int) -> None:
    """A Monitor made before ``fully_shard`` (which puts new parameters in place of each
    module's) measures the parameters the model has when it logs: its norms and gradient
    norms are those of the sharded parameters made whole (before: the replaced ones, which
    no backward reaches, so no gradient norm at all)."""
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    mon = hs.Monitor(model, every=1)
    for m in [*(m for m in model if isinstance(m, nn.Linear)), model]:
        fully_shard(m)
    with mon:
        model(_batch().chunk(world)[rank]).pow(2).sum().backward()
        mon.step()
    whole = {n: p.full_tensor().reshape(-1) for n, p in model.named_parameters()}
    grads = {n: p.grad.full_tensor().reshape(-1) for n, p in model.named_parameters()}
    got = {r["layer"]: r for r in mon.records if r["kind"] == "parameter"}
    assert sorted(got) == ["0", "2", "4"], got
    for layer, r in got.items():
        names = (f"{layer}.weight", f"{layer}.bias")
        assert r["norm"] == pytest.approx(float(torch.cat([whole[n] for n in names]).norm()))
        want = float(torch.cat([grads[n] for n in names]).norm())
        assert r["grad_norm"] == pytest.approx(want, rel=1e-6), (layer, r)


def _check_raise_mid_step(rank: int, world: int, ranks: Any) -> None:
    """A logged step whose all-reduce is in flight when the next step raises in the middle
    (after its forward, on every rank): leaving the ``with`` block waits for it, once, and
    the step's records are all there, in the sink too (rank 0 under "reduce")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    for m in [*model, model]:
        if isinstance(m, nn.Linear) or m is model:
            fully_shard(m, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _batch().chunk(world)[rank]
    sink = _Sink()
    with _Collectives() as seen, pytest.raises(RuntimeError, match="in the middle"):
        with hs.Monitor(model, every=1, optimizer=opt, ranks=ranks, sinks=[sink]) as mon:
            model(x).pow(2).sum().backward()
            opt.step()  # step 0, logged
            model(x)  # step 1 starts: step 0's values are sent ("reduce")
            raise RuntimeError("in the middle of step 1")
    assert len(seen.started) == 1, seen.groups  # (one group: the world)
    assert [len(w.waited_in) for w in seen.started] == [1], seen.started
    kinds = {(r["step"], r["kind"]) for r in mon.records}
    assert kinds == {(0, "activation"), (0, "gradient"), (0, "parameter")}, kinds
    assert sink.records == ([] if ranks == "reduce" and rank > 0 else mon.records)


def _check_records(
    records: list[dict[str, Any]], want: Any, rank: int, world: int, ranks: str
) -> None:
    assert sorted({r["step"] for r in records}) == [0, 2]
    for r in records:
        step = want[r["step"] + 1]
        stats = {k: v for k, v in r.items() if k not in ("step", "layer", "kind", "rank")}
        if r["kind"] == "parameter":
            expected = step[r["layer"], "parameter"]
            if r["step"] == 2 and r["layer"] == "0":  # the NaN, found once
                assert expected["grad_nonfinite"] == 1 and math.isnan(expected["grad_norm"])
            assert stats == pytest.approx(expected, rel=1e-6, nan_ok=True), (r, expected)
            continue
        else:
            t = step[r["layer"], r["kind"]]
            if ranks == "each":
                t = t.chunk(world)[rank]
            expected = _hand(t, dead=r["kind"] == "activation" and r["layer"] in ("1", "3"))
        if "mean" in expected:
            # the mean and std of values that cancel (a mean near 0), or of values far from
            # their mean (a std from sum of squares minus n mean^2, as ranks combine them),
            # lose relative precision in float32 sharded or not: within 1e-6 of the RMS
            rms = expected["norm"] / math.sqrt(t.numel())
            for key in ("mean", "std"):
                assert stats.pop(key) == pytest.approx(expected.pop(key), abs=1e-6 * rms), r
        assert stats == pytest.approx(expected, rel=1e-6), (r, expected)
    kinds = {(r["layer"], r["kind"]) for r in records if r["step"] == 0}
    layers = [str(i) for i in range(5)]
    assert kinds == {(n, k) for n in layers for k in ("activation", "gradient")} | {
        (n, "parameter") for n in ("0", "2", "4")
    }


def test_fsdp2_two_ranks_monitor_like_hand_statistics_unsharded(tmp_path: Path) -> None:
    _spawn(_monitor_rank, (2, str(tmp_path), False), tmp_path, nprocs=2, seconds=150)


def test_hsdp_two_by_two_monitor_combines_over_the_shard_dimension_only(tmp_path: Path) -> None:
    _spawn(_monitor_rank, (4, str(tmp_path), True), tmp_path, nprocs=4, seconds=200)


# -- hs.nonfinite under FSDP2 ------------------------------------------------------------------


class _Log(nn.Module):
    """``log`` of the inputs: NaN exactly where an input is negative."""

    def forward(self, x: Tensor) -> Tensor:
        return x.log()


def _log_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        _Log(), nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 1)
    )


def _nonfinite_rank(rank: int, world: int, out: str, hsdp: bool) -> None:
    """One rank of the NaN tracer test, with a process-group timeout: a collective that waits
    for a peer that never comes ends in an error (see :func:`_fsdp_rank` for the rest)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        init = f"file://{out}/init"
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=30)
        )
        torch.set_num_threads(1)
        _check_tracer(rank, world, hsdp)
        dist.destroy_process_group()
    except BaseException:
        import traceback

        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def _check_tracer(rank: int, world: int, hsdp: bool) -> None:
    """hs.nonfinite on the FSDP2 (or HSDP: 2 replicas x 2 shards) MLP behind a ``log``: a
    clean step raises nothing and adds one all-reduce over the world per check (forward,
    backward) to FSDP's collectives; then a negative input on rank 1 only (``log`` of it is
    the first NaN, by construction) is named on every rank: rank 1, the step, layer "0" and
    its operator ``aten.log``."""
    from collections import Counter

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = (2, world // 2) if hsdp else (world,)
    names = ("replicate", "shard") if hsdp else None
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _log_mlp()
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = _batch().abs().add(0.1).chunk(world)[rank]  # positive: log is finite

    def step(x: Tensor) -> None:
        model(x).pow(2).sum().backward()

    with _Collectives() as plain:  # FSDP's own collectives in one step
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
        bad[1, 2] = -1.0  # only rank 1's slice: log(-1) is NaN
    with hs.nonfinite(model) as report, pytest.raises(hs.NonFiniteError) as info:
        step(x)  # a clean step first: the finding is at step 2
        step(bad)
    error = info.value
    assert (error.rank, error.step, error.phase) == (1, 2, "forward"), str(error)
    assert (error.module, error.call, error.op) == ("0", 1, "aten.log"), str(error)
    assert "on rank 1 (forward 2)" in str(error) and "'0' (_Log)" in str(error), str(error)
    assert "operator aten.log" in str(error), str(error)
    # rank 1's measurement of the operator, on every rank: its one negative input, one NaN
    measured = error.stats
    assert measured["inputs"]["min"] == -1.0 and measured["outputs"]["nan"] == 1, measured
    assert report.findings == [error]
    # mode="warn": every rank warns of rank 1's forward and goes on; its backward is a
    # consequence, not a second finding
    with pytest.warns(RuntimeWarning, match="on rank 1"), hs.nonfinite(model, mode="warn") as r:
        step(bad)
    assert [(f.rank, f.step, f.module, f.op) for f in r.findings] == [(1, 1, "0", "aten.log")]
    # a backward: rank 1's loss is infinite, so the gradient entering its outputs is; FSDP's
    # reduce-scatter carries it into rank 0's pieces of the gradients too, but the first
    # producer is rank 1's loss
    model.zero_grad(set_to_none=True)
    with hs.nonfinite(model) as report, pytest.raises(hs.NonFiniteError) as info:
        (model(x).pow(2).sum() * (math.inf if rank == 1 else 1.0)).backward()
    error = info.value
    assert (error.rank, error.step, error.phase, error.module) == (1, 1, "backward", "<loss>")
    assert "on rank 1 (backward 1)" in str(error), str(error)
    assert report.findings == [error]
    # the model still trains, in step on both ranks: the gradients of a clean step are those
    # of the unsharded model on the whole batch
    model.zero_grad(set_to_none=True)
    step(x)
    oracle = _log_mlp()
    (oracle(_batch().abs().add(0.1)).pow(2).sum() / world).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), oracle.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7, msg=n)


def test_fsdp2_two_ranks_nonfinite_names_rank_one_on_every_rank(tmp_path: Path) -> None:
    _spawn(_nonfinite_rank, (2, str(tmp_path), False), tmp_path, nprocs=2, seconds=120)


def test_hsdp_two_by_two_nonfinite_names_rank_one_on_every_rank(tmp_path: Path) -> None:
    _spawn(_nonfinite_rank, (4, str(tmp_path), True), tmp_path, nprocs=4, seconds=180)


def _absent_peer_rank(rank: int, world: int, out: str, dies: bool) -> None:
    """Rank 1 runs the forward without the tracer and then waits (or dies); rank 0's tracer is
    then alone in its all-reduce at the end of the forward, and the process group's timeout
    (or the broken connection) ends it in an error. Rank 0 writes ``done`` (a waiting rank 1
    waits for it: leaving first would end rank 0's wait by a broken connection instead)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        init = f"file://{out}/init"
        dist.init_process_group(
            "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=5)
        )  # (what rank 0 waits for: 5 s is 100 times what the forward's all-gathers take)
        torch.set_num_threads(1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        model = _log_mlp()
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = _batch().abs().add(0.1).chunk(world)[rank]
        done = Path(out, "done")
        if rank == 1:
            model(x)
            if dies:
                os._exit(0)
            deadline = time.monotonic() + 90
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert done.exists(), "rank 0 never came out of its wait"
        else:
            with pytest.raises(RuntimeError) as info, hs.nonfinite(model):
                model(x)
            assert not isinstance(info.value, hs.NonFiniteError), info.value
            import traceback

            done.write_text("".join(traceback.format_exception(info.value)))
    except BaseException:
        import traceback

        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def test_fsdp2_nonfinite_with_an_absent_peer_ends_in_an_error(tmp_path: Path) -> None:
    _spawn(_absent_peer_rank, (2, str(tmp_path), False), tmp_path, nprocs=2, seconds=120)
    raised = (tmp_path / "done").read_text()
    assert "_nonfinite.py" in raised and "timed out" in raised.lower(), raised  # the check's


def test_fsdp2_nonfinite_with_a_peer_that_died_ends_in_an_error(tmp_path: Path) -> None:
    _spawn(_absent_peer_rank, (2, str(tmp_path), True), tmp_path, nprocs=2, seconds=120)
    raised = (tmp_path / "done").read_text()
    assert "_nonfinite.py" in raised, raised  # the tracer's all-reduce, not FSDP's all-gather
