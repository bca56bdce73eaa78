"""Shared fixtures. The autouse ``untouched`` check is the zero-residue promise: every model
and tensor hookscope touched during a test must afterwards be exactly as it was *before*
hookscope first touched it, and so must the process-global state hookscope may change.

It works from the outside: every public callable of ``hookscope`` is wrapped, for the test,
so that each ``nn.Module`` or tensor argument is snapshotted before the call runs. The
library itself carries no test machinery. ``residue.py`` holds the snapshot code;
``test_residue_fixture.py`` proves it catches each kind of residue."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from residue import Watch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per test process, and per process a test starts (OMP_NUM_THREADS is
# inherited): the suite's models are tiny, and a second intra-op thread mostly spins waiting
# for the first. test_zoo.py and test_hf.py at a load of 7-10 on 2 cores: 141-157 s with two
# threads, 54-63 s and half the CPU time with one. pytest-xdist's workers use the cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


#: Seconds each of the costliest files took in a full run with a worker per core (2 cores,
#: 2026-11, the sum of its tests' setup, call and teardown in ``--durations=0``). Only their
#: order matters: a file missing here comes after them, by its ``slow`` tests and its size.
FILE_SECONDS = {
    "test_extract.py": 80,
    "test_docs.py": 70,
    "test_explain_contract.py": 55,
    "test_hazards.py": 45,
    "test_cli_subprocess.py": 41,
    "test_sharded.py": 38,
    "test_sharded_tp.py": 36,
    "test_bench.py": 36,
    "test_extract_tokens.py": 27,
    "test_api.py": 24,
    "test_sharded_capture.py": 22,
    "test_extract_cli.py": 20,
    "test_integrations_lightning.py": 18,
    "test_hf.py": 16,
    "test_zoo.py": 15,
    "test_extract_pipeline.py": 13,
    "test_explain_memory.py": 12,
    "test_summary_hf.py": 11,
    "test_report.py": 11,
    "test_cli.py": 11,
    "test_demo.py": 10,
    "test_architecture.py": 10,
    "test_residue.py": 9,
    "test_patching.py": 9,
    "test_summary_ops.py": 9,
    "test_integrations_transformers.py": 8,
    "test_residue_fixture.py": 8,
    "test_steps.py": 10,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The costliest files first, each whole and in its order: pytest-xdist hands each worker
    a whole file at a time (:func:`pytest_xdist_make_scheduler`), so the long files start at
    once and the workers end on short ones together, rather than one waiting for the other's
    last long file; a module-scoped fixture is made once. Every worker sorts alike."""
    slow: dict[Path, int] = {}
    size: dict[Path, int] = {}
    for item in items:
        size[item.path] = size.get(item.path, 0) + 1
        slow[item.path] = slow.get(item.path, 0) + bool(item.get_closest_marker("slow"))

    def cost(item: pytest.Item) -> tuple[float, int, int]:
        path = item.path
        return (-FILE_SECONDS.get(path.name, 0), -slow[path], -size[path])

    items.sort(key=cost)  # (stable: a file's tests keep their order)


@pytest.hookimpl(optionalhook=True)  # (no error where pytest-xdist is missing or disabled)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole files to the workers, in the order of the collection (the costliest first: see
    :func:`pytest_collection_modifyitems`), the next file to the first worker with little left.
    pytest-xdist's default hands out runs of tests instead, the first quarter of each worker's
    share at once: one worker got every long file and ran for 207 s after the other ended."""
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # (xdist would order the files by their size)
    return LoadFileScheduling(config, log)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def untouched(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Watch]:
    """Snapshot what hookscope is handed before it first touches it; compare after the test.

    Tests whose model changes on purpose (gradient edits that are the point of the test,
    BatchNorm statistics in train mode, a DDP wrapper's own bookkeeping) mark themselves
    ``mutates_model``: parameter, buffer and attribute values are then not compared; hooks,
    training flags, requires_grad and the parameter and module lists still are.
    """
    watch = Watch()
    classes: set[type] = set()
    for name in hs.__all__:
        obj = getattr(hs, name)
        if isinstance(obj, type):
            if obj in classes or issubclass(obj, BaseException):
                continue
            classes.add(obj)
            if "__init__" in vars(obj):
                monkeypatch.setattr(obj, "__init__", watch.wrap(obj.__init__, method=True))
        elif callable(obj) and type(obj).__module__ != "typing":  # not a type alias
            monkeypatch.setattr(hs, name, watch.wrap(obj))
    yield watch
    values = request.node.get_closest_marker("mutates_model") is None
    problems = watch.problems(values=values)
    assert not problems, "hookscope did not leave things as found:\n" + "\n".join(problems)


# -- the demo's trained CNN, trained once per test run -------------------------------------------


@dataclass(frozen=True)
class DemoRun:
    """What ``hookscope demo --quick`` left: its report, its weights and what it printed."""

    report: Path
    weights: Path
    stdout: str


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """``python -m hookscope demo --quick``, run once per test run as a shell runs it.

    Training the demo's CNN is the costliest step of the suite, so this run's training is the
    only one: every test of a trained shapes model gets the weights it wrote (``shapes_cnn``).
    pytest-xdist's workers share it: the first to need it runs it, under a lock, in the run's
    folder that all workers see.
    """
    for extra in ("click", "matplotlib", "PIL"):
        pytest.importorskip(extra)
    from filelock import FileLock  # a dependency of torch

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder; a worker's own is popen-gw<N> inside it
    out, printed = root / "demo", root / "demo.stdout"
    with FileLock(str(root / "demo.lock")):
        if not printed.is_file():
            done = subprocess.run(
                [sys.executable, "-m", "hookscope", "demo", "--quick", "--out", str(out)],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            assert done.returncode == 0, done.stderr
            printed.write_text(done.stdout)
    return DemoRun(out / "report.html", out / "weights.pt", printed.read_text())


@pytest.fixture(scope="session")
def shapes_weights(request: pytest.FixtureRequest) -> dict[str, Tensor]:
    """The ``state_dict`` of the CNN ``hookscope demo --quick`` trains: the demo's own weights
    file, or, where the demo's extras are missing, the same training run here (``train`` seeds
    itself, so both are the same training)."""
    if all(importlib.util.find_spec(m) for m in ("click", "matplotlib", "PIL")):
        run: DemoRun = request.getfixturevalue("demo_run")
        weights: dict[str, Tensor] = torch.load(run.weights, weights_only=True)
        return weights
    from hookscope.show import train

    return train(300, size=32, progress_bar=False).state_dict()


@pytest.fixture
def shapes_cnn(shapes_weights: dict[str, Tensor]) -> nn.Module:
    """The demo's trained CNN (eval mode), a fresh copy for each test."""
    from hookscope.show import ShapesCNN

    model = ShapesCNN()
    model.load_state_dict(shapes_weights)
    return model.eval()
