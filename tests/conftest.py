"""Shared fixtures. The autouse ``untouched`` check is the zero-residue promise: every model
and tensor hookscope touched during a test must afterwards be exactly as it was *before*
hookscope first touched it, and so must the process-global state hookscope may change.

It works from the outside: every public callable of ``hookscope`` is wrapped, for the test,
so that each ``nn.Module`` or tensor argument is snapshotted before the call runs. The
library itself carries no test machinery. ``residue.py`` holds the snapshot code;
``test_residue_fixture.py`` proves it catches each kind of residue."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

import hookscope as hs
from residue import Watch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))


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
