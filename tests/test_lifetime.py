"""Sessions end when they say they do, whatever else happens: hooks of every kind are gone at
close (a later backward sees none), early stops and interrupts of one session leave other
sessions' passes right, sessions nest, copies of a hooked model are clean, process-global
state is restored exactly, and replicas are refused instead of mixed up."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from residue import HOOK_DICTS, global_state


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def hooks_of(model: nn.Module) -> int:
    return sum(len(getattr(m, d)) for m in model.modules() for d in HOOK_DICTS)


def grads_of(model: nn.Module) -> list[Tensor]:
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


# -- 1. every hook is disarmed at close ------------------------------------------------------
@pytest.mark.parametrize(
    "edit",
    [hs.scale(3.0, on="grad"), hs.scale(3.0, on="input_grad"), hs.clip_grad(value=1e-4)],
    ids=["grad", "input_grad", "clip_grad"],
)
def test_gradient_edit_does_not_outlive_its_block(edit: hs.Edit) -> None:
    model, x = mlp(), torch.randn(3, 4)
    model(x).pow(2).sum().backward()
    plain = grads_of(model)
    with hs.edit(model, {"2": edit}) as editor:
        out = model(x)  # the forward runs inside the block ...
    out.pow(2).sum().backward()  # ... the backward after it: no edit may apply
    assert editor.applied == {"2": 0}
    for got, want in zip(grads_of(model), plain, strict=True):
        assert torch.equal(got, want)


def test_capture_closed_before_backward_takes_no_gradients() -> None:
    model, x = mlp(), torch.randn(3, 4, requires_grad=True)
    with hs.capture(model, ["0", "2"], grads=True) as cap:
        out = model(x)
    held = cap.nbytes
    out.pow(2).sum().backward()
    assert cap.nbytes == held  # nothing charged by the late backward
    for read in (lambda: cap["2"].grad, lambda: cap["2"].grad_input, lambda: cap["0"].grad_input):
        with pytest.raises(hs.GradientUnavailableError, match="when the capture closed"):
            read()


def test_on_grad_after_remove_changes_nothing() -> None:
    x = torch.randn(3, requires_grad=True)
    z = x * 2
    with hs.on_grad(z, lambda g: g * 100):
        pass
    z.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


# -- 3. one session's early stop or an interrupt does not leave another inside a forward ------
class Interruptible(nn.Module):
    """Raises KeyboardInterrupt from inside its forward when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.interrupt = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.net[:2](x)
        if self.interrupt:
            raise KeyboardInterrupt
        return self.net[2:](h)


def _stop_features(model: Interruptible, x: Tensor) -> None:
    hs.features(model, x, "net.0")


def _stop_extractor(model: Interruptible, x: Tensor) -> None:
    hs.FeatureExtractor(model, ["net.0"])(x)


def _stop_capture(model: Interruptible, x: Tensor) -> None:
    with hs.capture(model, "net.2", stop=True):
        model(x)


def _interrupt(model: Interruptible, x: Tensor) -> None:
    model.interrupt = True
    try:
        model(x)
    except KeyboardInterrupt:
        pass
    finally:
        model.interrupt = False


INTERRUPTIONS = [_stop_features, _stop_extractor, _stop_capture, _interrupt]


@pytest.mark.parametrize("interrupt", INTERRUPTIONS, ids=lambda f: f.__name__[1:])
def test_patch_after_another_sessions_early_stop(interrupt: object) -> None:
    model, x, other = Interruptible(), torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        with hs.capture(model, "net.2") as src:
            model(other)
        with hs.edit(model, {"net.2": hs.patch(src)}) as editor:
            interrupt(model, x)  # type: ignore[operator]
            patched = model(x)  # a new pass: net.2 is call 0 again
            patched_again = model(x)
        want = model.net[4](model.net[3](src["net.2"].output))
    assert torch.equal(patched, want) and torch.equal(patched_again, want)
    assert editor.applied["net.2"] >= 2


@pytest.mark.parametrize("interrupt", INTERRUPTIONS, ids=lambda f: f.__name__[1:])
def test_capture_passes_do_not_merge_after_another_sessions_early_stop(interrupt: object) -> None:
    model, x = Interruptible(), torch.randn(3, 4)
    with torch.no_grad(), hs.capture(model, ["net.0", "net.4"]) as cap:
        model(x)
        interrupt(model, x)  # type: ignore[operator]
        out = model(x)
    assert cap["net.0"].count == 3 and cap["net.4"].count == 2  # net.4 never ran in between
    for name in ("net.0", "net.4"):  # keep="pass": only the last forward's calls
        assert [c.pass_index for c in cap[name].calls] == [2], name
    assert torch.equal(cap["net.4"].output, out)


# -- 9. copies of a hooked model ------------------------------------------------------------
def user_hook(module: nn.Module, args: object, output: Tensor) -> None:
    """A user's own (picklable) hook: copies keep it, as PyTorch always does."""


@pytest.mark.parametrize(
    "how",
    ["deepcopy", "pickle", "torch.save"],
)
def test_copies_inside_a_session_work_and_carry_no_hookscope_hooks(how: str) -> None:
    model, x = mlp(), torch.randn(3, 4, requires_grad=True)
    model[2].register_forward_hook(user_hook)  # the user's, kept by the model (and copies)
    with (
        hs.capture(model, ["0", "2"], inputs=True, grads=True) as cap,
        hs.edit(model, {"2": hs.scale(2.0), "4": hs.clip_grad(norm=1.0)}),
    ):
        model(x).sum().backward()
        if how == "deepcopy":
            twin = copy.deepcopy(model)
        elif how == "pickle":
            twin = pickle.loads(pickle.dumps(model))
        else:
            buffer = io.BytesIO()
            torch.save(model, buffer)
            buffer.seek(0)
            twin = torch.load(buffer, weights_only=False)
        assert hooks_of(twin) == 1 and list(twin[2]._forward_hooks.values()) == [user_hook]
        count = cap["0"].count
        twin(x)  # the copy is not watched by the capture, nor edited
        assert cap["0"].count == count
        assert torch.equal(twin(x), mlp()(x))
    model.zero_grad(set_to_none=True)


# -- 10. re-entering a session nests ----------------------------------------------------------
def test_reentering_a_capture_nests() -> None:
    model, x = mlp(), torch.randn(3, 4)
    cap = hs.capture(model, "0", keep="all")
    with torch.no_grad(), cap:
        with cap:
            model(x)
        model(x)  # still recording after the inner block
        assert cap["0"].count == 2
    model(x)
    assert cap["0"].count == 2 and hooks_of(model) == 0


# -- 11. process-global state is restored exactly, whatever the order -------------------------
def test_sessions_closing_out_of_order_restore_global_state() -> None:
    before = global_state()
    a, b, x = mlp(), mlp(), torch.randn(3, 4)
    ca, cb = torch.compile(a, backend="eager"), torch.compile(b, backend="eager")
    ca(x), cb(x)
    first = hs.capture(ca, "0", recompile=True).open()
    second = hs.edit(cb, {"0": hs.ablate()}, recompile=True).open()
    first.close()  # opened first, closed first: the second session must still work
    with torch.no_grad():
        assert torch.equal(cb(x), b[1:](torch.zeros(3, 8)))
    second.close()
    after = global_state()
    assert [k for k in before if not _equal(before[k], after[k])] == []
    with torch.no_grad():
        assert torch.equal(cb(x), b(x))


def _equal(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return a is b


def test_recompile_keeps_every_models_compiled_code() -> None:
    """recompile=True must not drop compiled code (dynamo shares it between instances of a
    class): after the session, both models run what was compiled before, no recompilation."""
    torch._dynamo.reset()
    compiled: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        compiled.append(1)
        return gm.forward

    a, b, x = mlp(), mlp(), torch.randn(3, 4)
    ca, cb = torch.compile(a, backend=backend), torch.compile(b, backend=backend)
    ca(x), cb(x)
    count = len(compiled)
    with torch.no_grad(), hs.capture(ca, "2", recompile=True) as cap:
        out = ca(x)
    assert torch.equal(cap["2"].output, a[:3](x)) and torch.equal(out, a(x))
    ca(x), cb(x)
    assert len(compiled) == count


# -- 12. replicas are refused, not mixed up ---------------------------------------------------
def test_data_parallel_over_several_devices_is_refused() -> None:
    model = mlp()
    wrapped = nn.DataParallel(model)
    wrapped.device_ids = [0, 1]  # what DataParallel holds on a machine with two GPUs
    with pytest.raises(hs.UnsupportedModelError, match="over 2 devices"):
        hs.capture(wrapped, "0").open()
    assert hooks_of(model) == 0


def test_a_replica_running_the_hooks_is_refused() -> None:
    model, x = mlp(), torch.randn(3, 4)
    replica = model._replicate_for_data_parallel()  # shares the hook dicts, as replicas do
    with pytest.raises(hs.UnsupportedModelError, match="copy of the hooked"):
        with hs.capture(model, "0"):
            replica(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_offload_of_outputs_and_gradients_waits_on_read() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(inplace=True), nn.Linear(256, 8)).cuda()
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    with hs.capture(model, ["0", "2"], grads=True, capture_device="cpu") as cap:
        model(x).pow(2).sum().backward()
        # no torch.cuda.synchronize() here: every read must wait for its own copy
        out, grad, grad_in = cap["0"].output, cap["2"].grad, cap["2"].grad_input
    for t in (out, grad, grad_in):
        assert t.device.type == "cpu" and t.is_pinned()
    with torch.no_grad():
        torch.testing.assert_close(out, model[0](x).cpu())
        y = model(x)
        torch.testing.assert_close(grad, (2 * y).cpu())  # d sum(y^2) / dy
        torch.testing.assert_close(grad_in, (2 * y @ model[2].weight).cpu())  # at 2's input
    model.zero_grad(set_to_none=True)


def test_closing_removes_every_hook_even_when_one_removal_raises() -> None:
    """One handle whose removal raises does not keep the hooks registered after it: every
    one is removed, then the error is raised."""
    from hookscope.core import HookSet

    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    hooks = HookSet()
    for layer in model:
        hooks.forward(layer, lambda *a: None)

    class Broken:
        def remove(self) -> None:
            raise RuntimeError("this handle cannot be removed")

    hooks._handles.insert(1, Broken())  # type: ignore[arg-type]  # between two real ones
    with pytest.raises(RuntimeError, match="cannot be removed"):
        hooks.close()
    assert all(not layer._forward_hooks for layer in model)
    assert len(hooks) == 0
    hooks.close()  # idempotent afterwards


# -- hookscope's own work is invisible to the user's torch function modes ----------------------
class Attending(nn.Module):
    """A linear layer, a softmax and a fused attention call: operations to select."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.softmax(self.lin(x), dim=-1)
        q = h.view(2, 1, 3, 8)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).view(2, 3, 8)


class Seen(torch.overrides.TorchFunctionMode):
    """The user's own mode: the name of every call it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


SESSIONS = {
    "capture": lambda m: hs.capture(m, "lin", grads=True, inputs=True),
    "capture operations": lambda m: hs.capture(
        m, ["::softmax", "::attention_weights", "::scaled_dot_product_attention"], grads=True
    ),
    "edit": lambda m: hs.edit(
        m, {"lin": [hs.scale(2.0), hs.scale(1.0, on="grad"), hs.scale(1.0, on="input_grad")]}
    ),
    "edit operations": lambda m: hs.edit(
        m, {"::softmax": hs.scale(1.0, on="grad"), "::attention_weights": hs.scale(1.0)}
    ),
    "Monitor": lambda m: hs.Monitor(m, layers=["lin", "::softmax"], every=1),
    "nonfinite": lambda m: hs.nonfinite(m),
}


@pytest.mark.mutates_model  # backward writes .grad
@pytest.mark.parametrize("outside", [False, True], ids=["mode inside", "mode outside"])
@pytest.mark.parametrize("name", list(SESSIONS))
def test_a_users_function_mode_sees_the_models_operations_only(name: str, outside: bool) -> None:
    """The same calls as without hookscope (no __get__, detach, clone, statistics), whether
    the user's mode was entered before the session opened or inside it."""
    torch.manual_seed(0)
    model, x = Attending(), torch.randn(2, 3, 8, requires_grad=True)

    def step() -> list[str]:
        with Seen() as seen:
            model(x).sum().backward()
        return seen.names

    want = step()
    assert "scaled_dot_product_attention" in want and "softmax" in want
    session = SESSIONS[name](model)  # (the test's residue fixture reads arguments here)
    if outside:
        with Seen() as seen, session:
            model(x).sum().backward()
        got = seen.names
    else:
        with session:
            got = step()
    assert got == want
    assert not torch.overrides._get_current_function_mode_stack()
