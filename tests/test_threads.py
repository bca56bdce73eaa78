"""Sessions and entry points used from several threads at once.

A model served from a thread pool, or a data-parallel loop in threads, runs forwards of one
model concurrently. Module hooks are shared by every thread, so a session sees them all; each
thread's forward must be its own pass, and the records those of the same forwards run one
after another. Entry points that run the model themselves must see only their own forward and
leave the training flags as found.

Oracles are plain PyTorch: the layer's output and the gradient of the loss w.r.t. it, computed
for each input alone with ``torch.autograd.grad``. Every scenario runs several rounds, with a
barrier so that the threads' forwards overlap, and a model that sleeps inside its forward so
that they interleave.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hookscope as hs

THREADS = 3
ROUNDS = 4


class Sleepy(nn.Module):
    """Lets the other threads run in the middle of a forward."""

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(0.002)
        return x


class Soft(nn.Module):
    """An operation site: ``"2::softmax"``."""

    def forward(self, x: Tensor) -> Tensor:
        p = torch.softmax(x, dim=-1)
        time.sleep(0.001)
        return p * x


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Sleepy(), Soft(), nn.Linear(8, 2))


def inputs(n: int, seed: int = 1) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g) for _ in range(n)]


def reference(model: nn.Sequential, x: Tensor) -> dict[str, Tensor]:
    """Layer 0's output and d loss / d output, the softmax's output, by plain autograd."""
    h = model[0](x)
    p = torch.softmax(model[1](h), dim=-1)
    loss = model[3](p * h).pow(2).sum()
    (g,) = torch.autograd.grad(loss, h)
    return {"out": h.detach(), "grad": g, "softmax": p.detach()}


def in_threads(work: Callable[[int, int], Any], threads: int = THREADS) -> list[Any]:
    """Run ``work(thread, round)`` for ROUNDS rounds in each of ``threads`` threads, the
    threads starting each round together; re-raise the first error."""
    barrier = threading.Barrier(threads)
    results: list[Any] = []
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            for r in range(ROUNDS):
                barrier.wait(timeout=30)
                results.append(work(t, r))
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)
            barrier.abort()

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in pool), "a thread hung"
    if errors:
        raise errors[0]
    return results


def which(value: Tensor, candidates: list[Tensor]) -> int:
    """The index of the candidate ``value`` equals (exactly one must)."""
    found = [i for i, c in enumerate(candidates) if torch.equal(c, value)]
    assert len(found) == 1, f"{len(found)} candidates match"
    return found[0]


@pytest.mark.parametrize("attempt", range(3))
def test_concurrent_forwards_under_one_capture_give_the_serial_records(attempt: int) -> None:
    """grads=True, keep="all": every call of every thread is recorded once, with its own
    gradient, in pass order, a layer's call and an operation's of one pass from one input."""
    model = make_model()
    xs = inputs(THREADS * ROUNDS, seed=attempt)
    refs = [reference(model, x) for x in xs]
    with hs.capture(model, ["0", "2::softmax"], grads=True, inputs=True, keep="all") as cap:

        def work(t: int, r: int) -> None:
            model(xs[t * ROUNDS + r]).pow(2).sum().backward()

        in_threads(work)
    layer, op = cap["0"].calls, cap["2::softmax"].calls
    assert len(layer) == len(op) == len(xs)
    passes = [c.pass_index for c in layer]
    assert passes == sorted(passes) and len(set(passes)) == len(xs)
    assert [c.pass_index for c in op] == passes
    assert [c.index for c in layer] == list(range(len(xs)))
    seen = set()
    for a, b in zip(layer, op, strict=True):
        i = which(a.output, [ref["out"] for ref in refs])
        seen.add(i)
        torch.testing.assert_close(a.grad, refs[i]["grad"], rtol=1e-5, atol=1e-6)
        assert torch.equal(a.input, xs[i])
        torch.testing.assert_close(b.output, refs[i]["softmax"], rtol=0, atol=0)
    assert seen == set(range(len(xs)))


@pytest.mark.parametrize("attempt", range(3))
def test_keep_pass_keeps_one_whole_pass_of_concurrent_forwards(attempt: int) -> None:
    model = make_model()
    xs = inputs(THREADS * ROUNDS, seed=10 + attempt)
    refs = [reference(model, x) for x in xs]
    with hs.capture(model, ["0", "2::softmax"], grads=True) as cap:
        in_threads(lambda t, r: model(xs[t * ROUNDS + r]).pow(2).sum().backward())
        layer, op = cap["0"].calls, cap["2::softmax"].calls
    assert len(layer) == len(op) == 1
    assert layer[0].pass_index == op[0].pass_index == cap.latest_pass
    i = which(layer[0].output, [ref["out"] for ref in refs])
    torch.testing.assert_close(layer[0].grad, refs[i]["grad"], rtol=1e-5, atol=1e-6)
    assert torch.equal(op[0].output, refs[i]["softmax"])


def test_an_operation_capture_keeps_a_record_per_concurrent_call() -> None:
    model = make_model()
    xs = inputs(THREADS * ROUNDS)
    with torch.no_grad(), hs.capture(model, "2::softmax", keep="all") as cap:
        in_threads(lambda t, r: model(xs[t * ROUNDS + r]))
    got = [c.output for c in cap["2::softmax"].calls]
    assert len(got) == len(xs)
    assert sorted(which(g, [reference(model, x)["softmax"] for x in xs]) for g in got) == list(
        range(len(xs))
    )


def test_edits_apply_to_every_threads_forward_and_count_exactly() -> None:
    model = make_model()
    xs = inputs(THREADS * ROUNDS)
    with torch.no_grad():
        want = [model[3](torch.zeros(3, 8)) for _ in xs]
    with torch.no_grad(), hs.edit(model, {"2": hs.ablate()}) as ed:
        got = in_threads(lambda t, r: model(xs[t * ROUNDS + r]))
    assert all(torch.equal(g, want[0]) for g in got)
    assert ed.applied == {"2": len(xs)}


def test_this_thread_sessions_see_only_the_threads_inside_them() -> None:
    """``this_thread=True``: the capture records and the edit changes only the forwards of
    the thread that opened it; another thread's forwards, run while it is open (and
    overlapping its own), are neither recorded nor edited."""
    model = make_model()
    xs = inputs(2 * ROUNDS)
    with torch.no_grad():
        want = [model(x) for x in xs]
        ablated = model[3](torch.zeros(3, 8))
    inside = threading.Barrier(2)
    got: dict[int, list[Tensor]] = {0: [], 1: []}

    def run(t: int) -> None:
        for r in range(ROUNDS):
            inside.wait()
            with torch.no_grad():
                got[t].append(model(xs[t * ROUNDS + r]))

    def opener() -> None:
        with (
            hs.capture(model, "0", keep="all", this_thread=True) as cap,
            hs.edit(model, {"2": hs.ablate()}, this_thread=True) as ed,
        ):
            run(0)
        calls = cap["0"].calls
        assert len(calls) == ROUNDS and ed.applied == {"2": ROUNDS}
        with torch.no_grad():
            assert all(torch.equal(c.output, model[0](xs[r])) for r, c in enumerate(calls))

    workers = [threading.Thread(target=opener), threading.Thread(target=run, args=(1,))]
    errors: list[BaseException] = []
    for w in workers:
        w.run = _reporting(w.run, errors)  # type: ignore[method-assign]
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert all(torch.equal(out, ablated) for out in got[0])
    assert all(torch.equal(out, want[ROUNDS + r]) for r, out in enumerate(got[1]))


def test_a_thread_that_enters_a_this_thread_session_is_seen_from_then_on() -> None:
    """A thread outside a ``this_thread=True`` capture is not recorded; once it enters the
    capture too (``with cap:`` on that thread) its forwards are, and after it leaves they
    are not again: whether a thread is one of the session's is asked anew when the thread
    enters or leaves (the sessions keep that answer per thread between forwards)."""
    model = make_model()
    xs = inputs(3)
    seen: list[int] = []

    def other(cap: Any) -> None:
        with torch.no_grad():
            model(xs[0])  # outside: not this capture's
            seen.append(len(cap["0"]))
            with cap:
                model(xs[1])
                seen.append(len(cap["0"]))
            model(xs[2])  # left again
            seen.append(len(cap["0"]))

    errors: list[BaseException] = []
    with hs.capture(model, "0", keep="all", this_thread=True) as cap:
        worker = threading.Thread(target=_reporting(lambda: other(cap), errors))
        worker.start()
        worker.join()
        assert not errors, errors
        assert seen == [0, 1, 1]
        with torch.no_grad():
            assert torch.equal(cap["0"].calls[0].output, model[0](xs[1]))


def _reporting(run: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    def wrapped() -> None:
        try:
            run()
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    return wrapped


class Noted(nn.Module):
    """Notes which thread ran it."""

    def __init__(self, notes: list[str]) -> None:
        super().__init__()
        self.notes = notes

    def forward(self, x: Tensor) -> Tensor:
        self.notes.append(threading.current_thread().name)
        return x


def test_a_thread_that_joins_mid_section_waits_for_the_first_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first thread's capture hot path takes no lock while it is the session's only
    thread; a second thread that starts a forward while the first is inside such a section
    waits for it to end (the handshake of ``Session._join``) before its forward runs."""
    notes: list[str] = []
    model = nn.Sequential(nn.Linear(4, 4), Noted(notes))
    x = torch.randn(2, 4)
    original = hs.LayerRecord._evict_all
    later = threading.Thread(target=lambda: model(x), name="later")

    def slow(record: hs.LayerRecord, *, grads: bool) -> None:
        if later.ident is None and notes == ["MainThread"]:  # layer 0, the second pass
            later.start()
            time.sleep(0.05)  # the later thread runs meanwhile, up to its join
            notes.append("section ends")
        original(record, grads=grads)

    monkeypatch.setattr(hs.LayerRecord, "_evict_all", slow)
    with torch.no_grad(), hs.capture(model, ["0", "1"]) as cap:
        model(x)
        model(x)
        later.join()
    assert sorted(notes) == ["MainThread", "MainThread", "later", "section ends"]
    assert notes.index("later") > notes.index("section ends")  # it waited
    assert cap["1"].count == 3


#: Sessions that register forward pre-hooks taking keyword arguments: a capture of inputs, an
#: edit, operation sites (their modules' calls are followed)
KWARG_HOOKS: dict[str, Callable[[nn.Module], Any]] = {
    "capture inputs": lambda m: hs.capture(m, "0", inputs=True),
    "edit of an input": lambda m: hs.edit(m, {"0": hs.scale(2.0, on="input")}),
    "operation site": lambda m: hs.capture(m, "0::linear"),
}


@pytest.mark.parametrize("kind", KWARG_HOOKS)
def test_a_forward_that_took_the_hooks_as_a_session_closed_runs_on(kind: str) -> None:
    """torch reads a module's pre-hooks and the set of those taking keyword arguments at two
    moments: a forward in one thread that took the hooks just before another thread closed a
    session calls that session's hook as a plain pre-hook, without keyword arguments. It must
    then do nothing (before: a TypeError inside the other thread's forward). The state between
    torch's two reads is made here by emptying the set while the session is open."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    want = model(x)
    with KWARG_HOOKS[kind](model):
        for module in model.modules():  # what close left for torch's second read: pre-hooks
            for name in ("_pre_hooks_with_kwargs", "_hooks", "_hooks_with_kwargs"):
                getattr(module, "_forward" + name).clear()  # the forward had already taken
            module._forward_hooks_always_called.clear()
        got = model(x)
    assert torch.equal(got, want)  # the forward is no longer the session's: nothing applied


def test_a_private_forward_in_one_thread_hides_nothing_of_another_threads() -> None:
    """hs.names(..., ops=True) runs a private forward; a NaN tracer replays one. Captures of
    another model in another thread record every call meanwhile."""
    watched = make_model()
    other = make_model()
    bad = nn.Sequential(nn.Linear(4, 4), nn.Identity())
    stop = threading.Event()
    x = torch.randn(3, 4)

    def private_forwards() -> None:
        while not stop.is_set():
            hs.names(other, ops=True, inputs=x)
            with pytest.raises(hs.NonFiniteError), hs.nonfinite(bad):
                bad(torch.full((1, 4), float("nan")))

    thread = threading.Thread(target=private_forwards)
    thread.start()
    try:
        recorded = 0
        for _ in range(80):
            with torch.no_grad(), hs.capture(watched, ["0", "2::softmax"]) as cap:
                watched(x)
            recorded += len(cap["0"].calls) == len(cap["2::softmax"].calls) == 1
    finally:
        stop.set()
        thread.join(timeout=60)
    assert recorded == 80


def train_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Dropout(0.5),
        Sleepy(),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    ).train()


def flags(model: nn.Module) -> list[bool]:
    return [m.training for m in model.modules()]


def test_concurrent_features_see_only_their_own_forward_and_keep_training_flags() -> None:
    model = train_model()
    xs = [torch.randn(2, 3, 8, 8) for _ in range(THREADS * ROUNDS)]
    with torch.no_grad():
        model.eval()
        want = [model[3](model[0](x)) for x in xs]  # eval: dropout off
        model.train()
    before = flags(model)
    got = in_threads(lambda t, r: (t * ROUNDS + r, hs.features(model, xs[t * ROUNDS + r], "3")))
    for i, feats in got:
        assert torch.equal(feats["3"], want[i])
    assert flags(model) == before


def test_concurrent_feature_extractors_on_one_model() -> None:
    model = train_model().eval()
    extractor = hs.FeatureExtractor(model, ["0", "3"])
    xs = [torch.randn(2, 3, 8, 8) for _ in range(THREADS * ROUNDS)]
    with torch.no_grad():
        want = [(model[0](x), model[3](model[0](x))) for x in xs]
    got = in_threads(lambda t, r: (t * ROUNDS + r, extractor(xs[t * ROUNDS + r])))
    for i, feats in got:
        assert torch.equal(feats["0"], want[i][0]) and torch.equal(feats["3"], want[i][1])


def test_concurrent_grad_cams_on_one_model_equal_the_serial_ones() -> None:
    model = train_model()
    cam = hs.GradCAM(model, "3")
    xs = [torch.randn(2, 3, 8, 8) for _ in range(THREADS * ROUNDS)]
    want = [cam(x, targets=0).maps for x in xs]
    before = flags(model)
    got = in_threads(lambda t, r: (t * ROUNDS + r, cam(xs[t * ROUNDS + r], targets=0).maps))
    for i, maps in got:
        torch.testing.assert_close(maps, want[i], rtol=1e-5, atol=1e-6)
    assert flags(model) == before


@pytest.mark.parametrize(
    "name", ["layer_integrated_gradients", "occlusion", "integrated_gradients"]
)
def test_concurrent_path_and_perturbation_methods_equal_the_serial_ones(name: str) -> None:
    """Layer integrated gradients replace the layer's output per thread; occlusion and
    integrated gradients run many forwards each: from several threads at once, each call
    gets its own maps."""
    model = train_model()
    method = {
        "layer_integrated_gradients": lambda: hs.LayerIntegratedGradients(model, "0", n_steps=4),
        "occlusion": lambda: hs.Occlusion(model, (3, 4, 4), strides=2, batch_size=8),
        "integrated_gradients": lambda: hs.IntegratedGradients(model, n_steps=4),
    }[name]()
    xs = [torch.randn(2, 3, 8, 8) for _ in range(THREADS * ROUNDS)]
    want = [method(x, targets=[0, 1]).maps for x in xs]
    before = flags(model)
    got = in_threads(lambda t, r: (t * ROUNDS + r, method(xs[t * ROUNDS + r], [0, 1]).maps))
    for i, maps in got:
        torch.testing.assert_close(maps, want[i], rtol=1e-5, atol=1e-6)
    assert flags(model) == before


def test_concurrent_summaries_of_one_model_equal_the_serial_one() -> None:
    model = train_model()
    x = torch.randn(2, 3, 8, 8)
    want = str(hs.summary(model, x))
    before = flags(model)
    got = in_threads(lambda t, r: str(hs.summary(model, x)))
    assert got == [want] * len(got)
    assert flags(model) == before


def test_entry_points_needing_other_modes_take_turns_and_restore_the_flags() -> None:
    """features runs the model in eval mode, summary(train=True) in training mode: on one
    model at once they take turns, each sees its own mode, and the flags end as found."""
    model = train_model().eval()
    model[1].train()  # a mixed model: each flag must come back as it was
    before = flags(model)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        want = model[3](model[0](x))

    def work(t: int, r: int) -> Any:
        if t % 2:
            return len(hs.summary(model, x, train=True).rows)
        return torch.equal(hs.features(model, x, "3")["3"], want)

    got = in_threads(work, threads=4)
    assert all(g is True for g in got if isinstance(g, bool))
    assert flags(model) == before


def test_a_nested_call_needing_the_other_mode_is_refused_clearly() -> None:
    model = train_model()

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x: Tensor) -> Tensor:
            hs.summary(model, x, train=True)  # inside features' eval forward, same thread
            return F.relu(self.inner(x))

    outer = Probe()
    hs.names(model)  # the untouched-model check takes its snapshot now, in training mode
    with pytest.raises(hs.UsageError, match="already runs Sequential in eval mode"):
        hs.features(outer, torch.randn(1, 3, 8, 8), "inner.0")
    assert all(flags(model))
