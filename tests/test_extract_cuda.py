"""hs.extract on CUDA: rows copied from the hooks into pinned host buffers without waiting, the
writer thread waiting for each block's copies (a CUDA event) before writing. The store equals
hand-written hooks reading the same batches with ``.cpu()``, as computed, for every storage
dtype and with a reduction, and a resumed store equals an uninterrupted one bit for bit. Needs a
CUDA device: CI has none, so these run on the GPU machine when one is lent."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import hookscope as hs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
zarr = pytest.importorskip("zarr")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 3),
    ).cuda()


X = torch.randn(200, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _hand(model: nn.Module, name: str, batch: int) -> np.ndarray:
    """A hand-written loop: a forward hook, the same batches, ``.cpu()`` per batch."""
    kept: list[torch.Tensor] = []
    handle = dict(model.named_modules())[name].register_forward_hook(
        lambda m, a, o: kept.append(o.detach().cpu())
    )
    try:
        with torch.no_grad():
            for i in range(0, len(X), batch):
                model(X[i : i + batch].cuda())
    finally:
        handle.remove()
    return torch.cat(kept).numpy()


@pytest.mark.parametrize("chunk", [40, 64])  # blocks of several batches; batches across blocks
def test_cuda_store_equals_the_hand_loop(tmp_path: Path, chunk: int) -> None:
    model = _cnn()
    store = hs.extract(model, X, ["1", "6"], out=tmp_path / "f", batch_size=20, chunk=chunk)
    for layer in ("1", "6"):
        np.testing.assert_allclose(store.to_numpy(layer), _hand(model, layer, 20), atol=1e-5)
    half = hs.extract(
        model,
        X,
        ["3"],
        out=tmp_path / "h",
        batch_size=20,
        dtype=torch.float16,
        reduce="spatial_mean",
    )
    want = torch.from_numpy(_hand(model, "3", 20)).mean((2, 3)).half().numpy()
    np.testing.assert_allclose(half.to_numpy("3"), want, atol=1e-3)


def test_cuda_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    model = _cnn()
    clean = hs.extract(model, X, ["1"], out=tmp_path / "clean", batch_size=20, chunk=40)
    out = tmp_path / "f"
    hs.extract(model, X, ["1"], out=out, batch_size=20, chunk=40)
    done = zarr.open_group(str(out), mode="r+")["done"]
    done[1], done[3] = False, False
    again = hs.extract(model, X, ["1"], out=out, batch_size=20, chunk=40, resume=True)
    assert np.array_equal(again.to_numpy("1"), clean.to_numpy("1"))
