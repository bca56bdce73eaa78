"""hs.extract(..., engine="distributed"): two and three processes (gloo, CPU) write one store
equal to the local engine's bit for bit, tokens and samples; a rank killed mid-run leaves the
blocks finished, and a resume with another number of ranks equals the local store. Every
launch has a timeout and leaves no process behind."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hookscope as hs
import zygote
from extract_oracle import TokenModel, cnn, token_items

zarr = pytest.importorskip("zarr")


def _rank(rank: int, world: int, port: int, jobs: list[str]) -> None:
    """Rank ``rank`` of ``world`` (in a child process): ``jobs`` in turn, each ``kind=out``."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model, items = TokenModel(), token_items()

    def tokens(out: str, **kwargs: Any) -> hs.FeatureStore:
        return hs.extract(model, items, out=out, engine="distributed", **TOKENS, **kwargs)

    for job in jobs:
        kind, out = job.split("=")
        if kind == "tokens":
            assert tokens(out).complete
        elif kind == "samples":
            x = torch.randn(50, 3, 10, 10, generator=torch.Generator().manual_seed(1))
            hs.extract(cnn(), x, ["1", "6"], out=out, batch_size=4, chunk=8, engine="distributed")
        elif kind == "resume":
            tokens(out, resume=True)
        elif kind == "killed":  # rank 1 dies in its third forward: its first block is done
            calls = [0]

            def die(module: Any, args: Any, output: Any, calls: list[int] = calls) -> None:
                calls[0] += 1
                if rank == 1 and calls[0] == 3:
                    os.kill(os.getpid(), signal.SIGKILL)

            handle = model.emb.register_forward_hook(die)
            try:
                tokens(out)
            finally:
                handle.remove()
    dist.destroy_process_group()


def _launch(
    world: int, jobs: list[str], folder: Path, timeout: float = 240
) -> list[tuple[int, str]]:
    """``world`` ranks running ``jobs`` in turn: (exit status, stderr) per rank. The ranks are
    forked from the tests' forkserver (see zygote.py: a fresh interpreter spent most of its
    time importing torch). Every rank is killed at the timeout, and none outlives the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks: list[zygote.Child] = []
    try:
        for rank in range(world):
            err = folder / f"rank{rank}of{world}.stderr"
            ranks.append(zygote.Child(_rank, rank, world, port, jobs, stderr_file=err))
        deadline = time.monotonic() + timeout
        statuses = [child.wait(timeout=max(0.0, deadline - time.monotonic())) for child in ranks]
        if None in statuses:
            raise TimeoutError(f"the {world} ranks did not finish in {timeout:.0f} s")
        return [(int(status or 0), child.stderr) for status, child in zip(statuses, ranks)]
    finally:
        for child in ranks:
            if child.process.is_alive():
                child.kill()


#: the token extraction both engines run (the distributed ranks and the local oracle)
TOKENS: dict[str, Any] = {
    "layers": ["mix", "emb"],
    "unit": "token",
    "batch_size": 6,
    "chunk": 12,
    "positions": (1, None),
}


def _local_tokens(out: Path) -> hs.FeatureStore:
    torch.manual_seed(0)
    return hs.extract(TokenModel(), token_items(), out=out, **TOKENS)


def _same(a: hs.FeatureStore, b: hs.FeatureStore) -> None:
    assert a.complete and a.ids == b.ids and a.layers == b.layers
    names = [*a.layers, *(("sample", "position", "token_id") if a.unit == "token" else ())]
    for name in names:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name][:], b[name][:]), name
    assert a.meta["samples"] == b.meta["samples"] and a.meta.get("tokens") == b.meta.get("tokens")


@pytest.mark.slow
def test_two_and_three_processes_write_the_local_store_also_after_a_kill(tmp_path: Path) -> None:
    local = _local_tokens(tmp_path / "local")
    x = torch.randn(50, 3, 10, 10, generator=torch.Generator().manual_seed(1))
    samples = hs.extract(cnn(), x, ["1", "6"], out=tmp_path / "local_s", batch_size=4, chunk=8)
    t3, s3, killed, t2 = (tmp_path / n for n in ("t3", "s3", "killed", "t2"))
    three = _launch(3, [f"tokens={t3}", f"samples={s3}", f"killed={killed}"], tmp_path)
    assert three[1][0] == -signal.SIGKILL, three[1][1]
    for status, err in (three[0], three[2]):  # the others are told, and stop
        assert status == 1 and ("rank 1" in err or "Connection" in err), err
    _same(hs.open_features(t3), local)
    _same(hs.open_features(s3), samples)
    with pytest.raises(hs.UsageError, match="unfinished"):
        hs.open_features(killed)
    ledger = zarr.open_group(str(killed), mode="r")
    assert 0 < ledger["done"][:].sum() < 10  # blocks finished before the kill are kept
    assert (ledger["block_tokens"][:] >= 0).all()  # the plan of every block
    two = _launch(2, [f"tokens={t2}", f"resume={killed}"], tmp_path)
    assert [status for status, _ in two] == [0, 0], two
    _same(hs.open_features(t2), local)
    _same(hs.open_features(killed), local)
    # and the local engine resumes a store the distributed one started, block plan and all
    zarr.open_group(str(t2), mode="r+")["done"][3:7] = False
    zarr.open_group(str(t2), mode="r+").attrs.update(
        {"hookscope": {**hs.open_features(t2).meta, "complete": False}}
    )
    torch.manual_seed(0)
    again = hs.extract(
        TokenModel(),
        token_items(),
        ["mix", "emb"],
        out=t2,
        unit="token",
        batch_size=6,
        chunk=12,
        positions=(1, None),
        resume=True,
    )
    _same(again, local)


def test_the_distributed_engine_needs_a_process_group(tmp_path: Path) -> None:
    with pytest.raises(hs.UsageError, match="init_process_group"):
        hs.extract(
            TokenModel(),
            token_items(),
            ["mix"],
            out=tmp_path / "f",
            unit="token",
            engine="distributed",
        )
    with pytest.raises(hs.UsageError, match="address by index"):
        hs.extract(
            TokenModel(),
            iter([torch.zeros(2, 3, dtype=torch.long)]),
            ["mix"],
            out=tmp_path / "f",
            engine="distributed",
        )
    assert not (tmp_path / "f").exists()
