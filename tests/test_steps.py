"""Generation steps: under ``model.generate(...)`` (greedy, KV cache, left padding, SDPA) each
record says its step (which forward of the model: 0 is the prefill) and the mask columns its
forward covered, and ``steps=`` limits ``hs.capture`` and ``hs.edit`` to some forwards.

Oracles: a plain forward of the whole prefix without a cache, read with plain forward hooks;
plain ``register_forward_hook`` edits applied on the forwards a plain pre-hook on the model
counts. Models: the random-weight GPT-2 and grouped-query Llama of ``test_units``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from test_units import HEAD_SIZE, MODELS, _inputs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

BLOCKS = {"gpt2": "transformer.h.{}", "llama": "model.layers.{}"}
RUN = {"do_sample": False, "pad_token_id": 0}


def _prefix(out: Tensor, mask: Tensor, length: int) -> dict[str, Tensor]:
    """The first ``length`` columns of generate()'s output as one plain forward's inputs: the
    prompt's mask extended by ones, and the positions generate gives each token."""
    full = torch.cat([mask, torch.ones(len(mask), length - mask.size(1), dtype=mask.dtype)], 1)
    positions = (full.cumsum(-1) - 1).masked_fill(full == 0, 1)
    return {"input_ids": out[:, :length], "attention_mask": full, "position_ids": positions}


def _plain_outputs(model: nn.Module, names: list[str], inputs: dict[str, Tensor]) -> list[Tensor]:
    """Each named module's output in one forward without a cache, by plain forward hooks."""
    seen: dict[str, Tensor] = {}
    handles = [
        model.get_submodule(name).register_forward_hook(
            lambda m, a, o, name=name: seen.__setitem__(name, o)
        )
        for name in names
    ]
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [seen[name] for name in names]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_each_steps_records_equal_a_forward_over_the_prefix(kind: str, cache: str) -> None:
    """Both blocks' outputs at every step of generate() equal a forward over the prefix
    without a cache at the columns each record says it covers (real tokens compared: a
    padding row's values depend on its arbitrary position id), and so does head 1's output
    (the SDPA call, heads=[1]) at the new token of each step. A static cache's keys have
    the cache's whole length; the mask generate passes, and so the positions, do not."""
    make, attention, _ = MODELS[kind]
    model, inputs = make(), _inputs("left")
    blocks = [BLOCKS[kind].format(i) for i in range(2)]
    z = f"{attention.format(1)}::scaled_dot_product_attention"
    run = dict(RUN, max_new_tokens=4, cache_implementation=cache)
    with torch.no_grad():
        # transformers notes a static cache's length on the model: a plain run first, so the
        # residue check compares the model as transformers leaves it
        model.generate(**inputs, **run)
        with hs.capture(model, blocks, keep="all") as cap:
            out = model.generate(**inputs, **run)
        with hs.capture(model, z, heads=[1], positions=[-1], keep="all") as heads:
            assert torch.equal(model.generate(**inputs, **run), out)
    mask = inputs["attention_mask"]
    for name in blocks:
        assert list(cap[name].steps) == [0, 1, 2, 3]
    spans = [range(7), range(7, 8), range(8, 9), range(9, 10)]
    assert [call.positions for call in cap[blocks[0]]] == spans
    for step in range(4):
        length = 7 + step
        prefix = _prefix(out, mask, length)
        columns = cap[blocks[0]].steps[step][0].positions
        assert columns is not None and columns.stop == length
        real = prefix["attention_mask"][:, columns].bool()
        for name, want in zip(blocks, _plain_outputs(model, blocks, prefix), strict=True):
            (call,) = cap[name].steps[step]
            assert call.step == step and call.positions == columns
            got = call.output
            torch.testing.assert_close(got[real], want[:, columns][real], rtol=0, atol=1e-5)
        (z_call,) = heads[z].steps[step]
        assert z_call.positions == columns and z_call.output.shape == (3, 1, 1, HEAD_SIZE)
        attn = model.get_submodule(attention.format(1))
        projection_input = _plain_inputs(model, attn, prefix)
        want_z = projection_input[:, -1, HEAD_SIZE : 2 * HEAD_SIZE]  # head 1, the last column
        torch.testing.assert_close(z_call.output[:, 0, 0], want_z, rtol=0, atol=1e-5)


def _plain_inputs(model: nn.Module, attention: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The output projection's input (every head's output side by side) in a forward without
    a cache, by a plain pre-hook."""
    projection = attention.c_proj if hasattr(attention, "c_proj") else attention.o_proj
    seen: list[Tensor] = []
    handle = projection.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return seen[0]


def _counted(model: nn.Module, site: nn.Module, chosen: set[int], fn: Callable[..., Any]) -> Any:
    """Plain hooks: a pre-hook on the model counts its forwards, a forward hook on ``site``
    applies ``fn(output, forward)`` on the ``chosen`` ones."""
    count = [-1]

    def pre(module: nn.Module, args: Any) -> None:
        count[0] += 1

    def post(module: nn.Module, args: Any, out: Tensor) -> Tensor | None:
        return fn(out, count[0]) if count[0] in chosen else None

    return model.register_forward_pre_hook(pre), site.register_forward_hook(post)


def _scores(model: nn.Module, inputs: dict[str, Tensor], steps: int = 7) -> tuple[Tensor, ...]:
    with torch.no_grad():
        got = model.generate(
            **inputs, max_new_tokens=steps, output_scores=True, return_dict_in_generate=True, **RUN
        )
    return tuple(got.scores)


def _scores_hooked(
    handles: Any, model: nn.Module, inputs: dict[str, Tensor], steps: int = 7
) -> tuple[Tensor, ...]:
    """:func:`_scores` with the plain hooks of ``handles`` on, removed after."""
    try:
        return _scores(model, inputs, steps)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_an_edit_limited_to_steps_3_to_5_changes_only_their_logits(kind: str) -> None:
    """The first block's output is edited: the edit reaches that step's logits through the
    later layer and, through the keys and values the later layer caches for the step's token,
    every later step too; so the oracle (the same function applied by a plain forward hook on
    the model's forwards 3, 4 and 5, counted by a plain pre-hook on the model) must match at
    every step, the unedited run at steps 0-2, and differ from it at steps 3-5."""
    make, _, _ = MODELS[kind]
    model, inputs = make(), _inputs("left")
    name = BLOCKS[kind].format(0)
    shift = torch.linspace(-1, 1, 64)

    def fn(h: Tensor) -> Tensor:
        return h + shift

    plain = _scores(model, inputs)
    with hs.edit(model, {name: fn}, steps=range(3, 6)) as ed:
        got = _scores(model, inputs)
    assert ed.applied[name] == 3
    handles = _counted(model, model.get_submodule(name), {3, 4, 5}, lambda out, _: fn(out))
    expected = _scores_hooked(handles, model, inputs)
    assert len(got) == len(expected) == len(plain) == 7
    for step, (g, e, p) in enumerate(zip(got, expected, plain, strict=True)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5, msg=f"step {step}")
        if step < 3:
            assert torch.equal(g, p), f"step {step} was edited"
        elif step < 6:
            assert not torch.allclose(g, p, atol=1e-3), f"step {step} was not edited"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_an_edit_of_the_logits_at_steps_3_to_5_leaves_every_other_step_as_it_was(
    kind: str,
) -> None:
    """The issue's words taken literally: an edit after every layer that caches keys and
    values (the logits, +1 everywhere: greedy decoding picks the same tokens) changes the
    scores of steps 3, 4 and 5 by exactly that, and those of every other step not at all."""
    make, _, _ = MODELS[kind]
    model, inputs = make(), _inputs("left")
    plain = _scores(model, inputs)
    with hs.edit(model, {"lm_head": hs.add(1.0)}, steps=[3, 4, 5]) as ed:
        got = _scores(model, inputs)
    assert ed.applied["lm_head"] == 3 and len(got) == len(plain) == 7
    for step, (g, p) in enumerate(zip(got, plain, strict=True)):
        if step in (3, 4, 5):
            torch.testing.assert_close(g, p + 1.0, rtol=0, atol=1e-5, msg=f"step {step}")
        else:
            assert torch.equal(g, p), f"step {step} changed"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_patch_of_a_capture_with_steps_applies_at_the_same_steps(kind: str) -> None:
    """A clean run's block output captured at steps 3-5, patched into a corrupted prompt's
    generate() at steps 3-5: each step gets the clean run's value of that step (the oracle:
    plain hooks recording the clean forwards 3-5 and writing them into the same forwards of
    the corrupted run)."""
    make, _, _ = MODELS[kind]
    model, clean = make(), _inputs("left")
    corrupted = dict(clean, input_ids=(clean["input_ids"] + 1) % 100)
    name = BLOCKS[kind].format(0)
    site = model.get_submodule(name)
    with torch.no_grad(), hs.capture(model, name, steps=range(3, 6)) as cap:
        model.generate(**clean, max_new_tokens=6, **RUN)
    assert list(cap[name].steps) == [3, 4, 5]
    with hs.edit(model, {name: hs.patch(cap)}, steps=range(3, 6)):
        got = _scores(model, corrupted)
    seen: dict[int, Tensor] = {}
    handles = _counted(model, site, {3, 4, 5}, lambda out, k: seen.__setitem__(k, out.clone()))
    _scores_hooked(handles, model, clean, steps=6)
    handles = _counted(model, site, {3, 4, 5}, lambda out, k: seen[k])
    expected = _scores_hooked(handles, model, corrupted)
    unpatched = _scores(model, corrupted)
    for step, (g, e, u) in enumerate(zip(got, expected, unpatched, strict=True)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5, msg=f"step {step}")
        assert torch.equal(g, u) == (step < 3), f"step {step}"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_patch_of_one_head_at_the_new_token_aligns_by_step_and_position(kind: str) -> None:
    """Head 1's output at each step's new token (positions=[-1], heads=[1]) captured from a
    clean run at steps 3-5 and patched into a corrupted run's same steps and units equals
    writing the clean run's head-1 columns of the output projection's input into the
    corrupted run's last position at its forwards 3-5 (plain hooks; the Llama's decoding
    steps are packed grouped-query calls, see test_units)."""
    make, attention, _ = MODELS[kind]
    model, clean = make(), _inputs("left")
    corrupted = dict(clean, input_ids=(clean["input_ids"] * 7 + 3) % 100)
    z = f"{attention.format(1)}::scaled_dot_product_attention"
    units: dict[str, Any] = {"heads": [1], "positions": [-1], "steps": range(3, 6)}
    with torch.no_grad(), hs.capture(model, z, **units) as cap:
        model.generate(**clean, max_new_tokens=6, **RUN)
    assert [call.output.shape for call in cap[z]] == [(3, 1, 1, HEAD_SIZE)] * 3
    with hs.edit(model, {z: hs.patch(cap)}, **units):
        got = _scores(model, corrupted)
    attn = model.get_submodule(attention.format(1))
    projection = attn.c_proj if kind == "gpt2" else attn.o_proj
    columns = slice(HEAD_SIZE, 2 * HEAD_SIZE)
    seen: dict[int, Tensor] = {}
    count = [-1]

    def pre(module: nn.Module, args: Any) -> None:
        count[0] += 1

    def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        if count[0] in (3, 4, 5):
            seen[count[0]] = args[0][:, -1, columns].clone()

    def write(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor] | None:
        if count[0] not in (3, 4, 5):
            return None
        x = args[0].clone()
        x[:, -1, columns] = seen[count[0]]
        return (x,)

    for hook, inputs in ((record, clean), (write, corrupted)):
        count[0] = -1
        handles = [model.register_forward_pre_hook(pre), projection.register_forward_pre_hook(hook)]
        expected = _scores_hooked(handles, model, inputs, steps=6 if hook is record else 7)
    unpatched = _scores(model, corrupted)
    for step, (g, e, u) in enumerate(zip(got, expected, unpatched, strict=True)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5, msg=f"step {step}")
        if step < 6:  # (the last layer's head output enters no cache: step 6 may be as before)
            assert torch.equal(g, u) == (step < 3), f"step {step}"


# -- records of any model ------------------------------------------------------------------------
def test_positions_of_forwards_without_a_mask_or_token_inputs() -> None:
    embed = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    with hs.capture(embed, "1", keep="all") as cap:
        embed(torch.tensor([[1, 2, 3]]))
    assert cap["1"].last.step == 0 and cap["1"].last.positions is None  # no input_ids named
    model = MODELS["gpt2"][0]()
    with torch.no_grad(), hs.capture(model, "transformer.h.0") as cap:
        model(torch.tensor([[1, 2, 3]]))  # input_ids by position, no mask, no cache
    assert cap["transformer.h.0"].last.positions == range(3)


# -- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("steps", "match"),
    [
        (-1, "cannot be negative"),
        ([2, -1], "cannot be negative"),
        ([1, 1], "names a step twice"),
        (True, "give an int"),
        ([True], "give an int"),
        ([], "at least one"),
        ("3", "give an int"),
        ([1.0], "give an int"),
    ],
)
def test_bad_steps_are_refused(steps: Any, match: str) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(hs.UsageError, match=match):
        hs.capture(model, "0", steps=steps)
    with pytest.raises(hs.UsageError, match=match):
        hs.edit(model, {"0": hs.ablate()}, steps=steps)


def test_steps_on_a_layer_called_outside_a_forward_are_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    x = torch.ones(1, 2)
    with hs.capture(model, "0", steps=0) as cap:
        with pytest.raises(hs.UsageError, match="outside any"):
            model[0](x)
        model(x)
    assert len(cap["0"].calls) == 1
    with hs.capture(model, "1::relu", steps=0), pytest.raises(hs.UsageError, match="outside any"):
        model[1](x)
    with hs.edit(model, {"0": hs.ablate()}, steps=0):
        with pytest.raises(hs.UsageError, match="outside any"):
            model[0](x)
        assert torch.equal(model(x), torch.zeros(1, 2))


def test_steps_count_from_when_the_session_was_built() -> None:
    """A session that already saw forwards would count on from them: reopening it with
    steps= is refused, naming the fix (a new session per generate() call)."""
    model = nn.Sequential(nn.Linear(2, 2))
    x = torch.ones(1, 2)
    for session in (hs.capture(model, "0", steps=[1]), hs.edit(model, {"0": hs.ablate()}, steps=1)):
        with session:
            model(x)
        with pytest.raises(hs.UsageError, match="already saw 1"), session:
            pass


def test_parameter_gradient_edits_with_steps_are_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(hs.UsageError, match="parameter gradients"):
        hs.edit(model, {"0": hs.clip_grad(norm=1.0)}, steps=[0])


def test_steps_keep_every_call_of_the_chosen_steps_and_leave_others_alone() -> None:
    """The default keep= with steps= keeps every chosen step; other forwards run as without
    the session (the output of an edited step only is changed)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    xs = [torch.randn(1, 2, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        plain = [model(x) for x in xs]
        with hs.capture(model, ["0", "1::relu"], steps=[0, 2]) as cap:
            for x in xs:
                model(x)
        with hs.edit(model, {"0": hs.ablate()}, steps=[1]):
            edited = [model(x) for x in xs]
    assert list(cap["0"].steps) == list(cap["1::relu"].steps) == [0, 2]
    torch.testing.assert_close(cap["0"].steps[2][0].output, model[0](xs[2]), rtol=0, atol=0)
    for i, (e, p) in enumerate(zip(edited, plain, strict=True)):
        assert torch.equal(e, p) == (i != 1), i


def test_a_patch_from_other_steps_is_refused() -> None:
    """A source of several steps patches the same steps only: a forward of a step the source
    lacks is refused, naming the steps it has."""
    model = nn.Sequential(nn.Linear(2, 2))
    x = torch.ones(1, 2)
    with torch.no_grad(), hs.capture(model, "0", steps=[0, 1]) as cap:
        for _ in range(2):
            model(x)
    with torch.no_grad(), hs.edit(model, {"0": hs.patch(cap)}):
        model(x + 1)
        model(x + 1)
        with pytest.raises(hs.EditError, match=r"steps \[0, 1\] and this is step 2"):
            model(x + 1)
