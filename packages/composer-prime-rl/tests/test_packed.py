"""Samples that are views of one packed micro-batch (PRIME-RL's train loop: every field a ``[1, N]`` tensor,
``.squeeze().split(sequence_lengths)``): the shared per-token work runs once per micro-batch, and every result
equals the same samples passed as separate tensors (issue 19)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from composer_prime_rl import LossInputs, LossOutputs, composer_loss
from composer_prime_rl import inputs as inputs_module
from composer_prime_rl import loss as loss_module

LENGTHS = (6, 1, 9, 4)
CONFIGS: list[dict[str, Any]] = [
    {},
    {"kl_tau": 0.05, "dppo_mask_low": 0.1, "dppo_mask_high": 0.3, "adv_tau": 0.7},
    {"policy_loss": "clipped_surrogate", "epsilon_low": 0.2, "epsilon_high": 0.28, "delta": 3.0},
    {"alpha_sdpo": 0.5, "sdpo_token_clip": 2.0},
    {"policy_loss": "clipped_surrogate", "alpha_sdpo": 1.0},
]


@pytest.fixture(autouse=True, params=["where", "vectorised"])
def form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs both CPU forms: torch.where (few tokens) and its vectorised equivalents (a packed
    micro-batch of VECTORISED_FROM tokens or more; forced here on these small ones)."""
    if request.param == "vectorised":
        monkeypatch.setattr(inputs_module, "VECTORISED_FROM", 0)
    return str(request.param)


def _fields(seed: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """One packed micro-batch, [N] per field; sample 2's ref_logprobs are PRIME-RL's zero fill."""
    g = torch.Generator().manual_seed(seed)
    n = sum(LENGTHS)
    p_inf = torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05
    p_train = (p_inf + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.6).clamp(0.02, 0.98)
    ref = (torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05).log()
    ref[sum(LENGTHS[:2]) : sum(LENGTHS[:3])] = 0.0
    adv = torch.cat([torch.randn(1, generator=g, dtype=torch.float64).expand(k) for k in LENGTHS])
    mask = torch.rand(n, generator=g) > 0.25
    mask[sum(LENGTHS[:1])] = False  # the one-token sample selects nothing
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    values = {"lp": p_train.log(), "inf": p_inf.log(), "ref": ref, "adv": adv, "w": weights}
    return {**{k: v.to(dtype) for k, v in values.items()}, "mask": mask}


def _step(
    f: dict[str, torch.Tensor],
    kwargs: dict[str, Any],
    packed: bool,
    weighted: bool = False,
    rl_stream: bool = False,
) -> tuple[list[LossOutputs], torch.Tensor]:
    """Every sample's outputs and d(Σ losses)/d(log-probs). ``packed``: PRIME-RL's views of ``[1, N]`` tensors
    (the log-probs a non-leaf, as the forward's output); else each sample's own tensors. ``rl_stream``: the
    micro-batch carries rl weights, so PRIME-RL's ``compute_loss`` builds each sample's mask afresh,
    ``mask & (rl_weights != 0)``, and passes ``loss_weights = rl_weights``."""
    leaf = f["lp"].clone().requires_grad_(True)
    source = {**f, "lp": leaf[None] * 1.0}
    if packed:
        split = {k: v.reshape(1, -1).squeeze().split(list(LENGTHS)) for k, v in source.items()}
    else:
        split = {k: [t.clone() for t in v.reshape(-1).split(list(LENGTHS))] for k, v in source.items()}
    outs = []
    for i in range(len(LENGTHS)):
        s = {k: v[i] for k, v in split.items()}
        mask = s["mask"] & (s["w"] != 0) if rl_stream else s["mask"]
        weights = s["w"] if weighted or rl_stream else None
        inputs = LossInputs(s["lp"], s["inf"], s["ref"], s["adv"], mask, weights)
        outs.append(composer_loss(inputs, **kwargs))
    torch.stack([o.loss for o in outs]).sum().backward()
    assert leaf.grad is not None
    return outs, leaf.grad


def _views(f: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """PRIME-RL's per-sample views: each ``[N]`` field as a ``[1, N]`` micro-batch tensor, squeezed and split."""
    return {k: v[None].squeeze().split(list(LENGTHS)) for k, v in f.items()}


def _inputs(views: dict[str, tuple[torch.Tensor, ...]], i: int, clone: bool = False) -> LossInputs:
    """Sample ``i``'s LossInputs (unweighted) from the views; ``clone``: as its own tensors instead."""
    fields = (views[k][i] for k in ("lp", "inf", "ref", "adv", "mask"))
    return LossInputs(*(t.clone() if clone else t for t in fields))


def _rl_inputs(views: dict[str, tuple[torch.Tensor, ...]], i: int, clone: bool = False) -> LossInputs:
    """Sample ``i``'s LossInputs under an rl weight stream, as PRIME-RL's ``compute_loss`` builds them: a fresh
    ``mask & (w != 0)`` and ``loss_weights = w``; ``clone``: every field its own tensor instead of a view."""
    v = {k: t[i].clone() if clone else t[i] for k, t in views.items()}
    return LossInputs(v["lp"], v["inf"], v["ref"], v["adv"], v["mask"] & (v["w"] != 0), v["w"])


def _assert_same(
    a: tuple[list[LossOutputs], torch.Tensor], b: tuple[list[LossOutputs], torch.Tensor]
) -> None:
    for x, y in zip(a[0], b[0], strict=True):
        torch.testing.assert_close(x.loss, y.loss, rtol=1e-12, atol=1e-14)
        assert x.metrics.keys() == y.metrics.keys()
        for key in x.metrics:
            torch.testing.assert_close(x.metrics[key], y.metrics[key], rtol=1e-6, atol=1e-7, msg=key)
    torch.testing.assert_close(a[1], b[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kwargs", CONFIGS)
@pytest.mark.parametrize("weighted", [False, True])
def test_packed_samples_equal_separate_ones(kwargs, weighted) -> None:
    f = _fields(0)
    _assert_same(
        _step(f, kwargs, packed=True, weighted=weighted), _step(f, kwargs, packed=False, weighted=weighted)
    )


@pytest.mark.parametrize("kwargs", [CONFIGS[0], CONFIGS[4]])
def test_the_zero_filled_sample_skips_channel_2_when_packed(kwargs) -> None:
    outs, grad = _step(_fields(1), kwargs, packed=True)
    if kwargs.get("alpha_sdpo"):
        assert [o.metrics["composer/sdpo/skipped"].item() for o in outs] == [0.0, 0.0, 1.0, 0.0]
        assert outs[2].metrics["composer/loss/sdpo"].item() == 0.0
    empty = outs[1]  # its only token is outside the mask
    assert empty.loss.item() == 0.0 and all(v.item() == 0.0 for v in empty.metrics.values())
    assert grad[LENGTHS[0]].item() == 0.0


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_a_packed_micro_batch_reads_the_host_once(kwargs, monkeypatch, host_reads) -> None:
    """The value checks of every sample of a micro-batch are one fused condition over the packed tensors,
    read once (before: once per sample, a device sync per call on an accelerator)."""
    f = _fields(2)
    leaf = f["lp"].clone().requires_grad_(True)
    views = _views({**f, "lp": leaf * 1.0})
    calls = host_reads()
    outs = [composer_loss(_inputs(views, i), **kwargs) for i in range(len(LENGTHS))]
    assert len(calls) <= 1, calls
    monkeypatch.undo()
    torch.stack([o.loss for o in outs]).sum().backward()


def _assert_sample_2_raises_and_the_others_train(
    views: Any, inputs_of: Any, clean: list[LossOutputs], field: str
) -> None:
    """Sample 2 holds a bad value of ``field``: its call raises naming it, every other call gives its clean
    result."""
    for i in range(len(LENGTHS)):
        inputs = inputs_of(views, i)
        if i == 2:
            with pytest.raises(ValueError, match=rf"LossInputs\.{field} has NaN or inf"):
                composer_loss(inputs)
            continue
        torch.testing.assert_close(composer_loss(inputs).loss, clean[i].loss, rtol=1e-12, atol=1e-14)


def test_a_bad_value_raises_at_its_own_sample_and_the_others_train() -> None:
    """The packed check fails: each sample is then checked on its own, so the error names the field at the
    sample that holds the NaN, and clean samples before and after it give their normal results."""
    f = _fields(3)
    bad = sum(LENGTHS[:2]) + 1
    f["inf"][bad] = math.nan
    f["mask"][bad] = True
    clean = _step(_fields(3), {}, packed=False)[0]
    _assert_sample_2_raises_and_the_others_train(_views(f), _inputs, clean, "inference_logprobs")


def test_an_in_place_change_between_calls_is_seen() -> None:
    """The shared work is matched by identity and version counter: a field changed in place after the first
    sample (a new micro-batch written into the same buffer) is recomputed, never read stale."""
    f = _fields(4)
    views = _views(f)
    composer_loss(_inputs(views, 0))
    f["adv"].neg_()  # in place: the views see it
    got = composer_loss(_inputs(views, 3)).loss
    torch.testing.assert_close(got, composer_loss(_inputs(views, 3, clone=True)).loss)
    assert got.item() != 0.0


def test_a_new_micro_batch_of_the_same_shape_is_recomputed() -> None:
    """Each micro-batch's tensors are new objects (PRIME-RL moves them per micro-batch): the previous one's
    work is never reused, even where the allocator hands out the same memory."""
    for seed in range(4):
        f = _fields(10 + seed)
        views = _views(f)
        got = composer_loss(_inputs(views, 0)).loss
        torch.testing.assert_close(got, composer_loss(_inputs(views, 0, clone=True)).loss, rtol=0, atol=0)
        del f, views


@pytest.mark.parametrize("kwargs", [CONFIGS[0], CONFIGS[2]])
def test_the_next_micro_batch_reuses_the_table_memory_and_changes_no_result(kwargs) -> None:
    """Issue 63: a packed micro-batch writes its table into the last one's memory (no page faults on CPU). The
    earlier micro-batch's losses still backpropagate their own gradient, a separate-tensor call in between
    reuses nothing, and every micro-batch still equals its samples computed one by one."""
    first, second = _fields(21), _fields(22)
    a_leaf, b_leaf = first["lp"].clone().requires_grad_(True), second["lp"].clone().requires_grad_(True)
    a_views, b_views = _views({**first, "lp": a_leaf * 1.0}), _views({**second, "lp": b_leaf * 1.0})
    a = [composer_loss(_inputs(a_views, i), **kwargs) for i in range(len(LENGTHS))]
    table = loss_module._Last.table
    alone = composer_loss(_inputs(_views(_fields(23)), 1, clone=True), **kwargs)  # separate: its own table
    b = [composer_loss(_inputs(b_views, i), **kwargs) for i in range(len(LENGTHS))]
    assert table is not None and loss_module._Last.table is table  # the same memory, rewritten
    torch.stack([o.loss for o in a]).sum().backward()
    torch.stack([o.loss for o in b]).sum().backward()
    _assert_same((a, a_leaf.grad), _step(first, kwargs, packed=False))
    _assert_same((b, b_leaf.grad), _step(second, kwargs, packed=False))
    torch.testing.assert_close(alone.loss, composer_loss(_inputs(_views(_fields(23)), 1), **kwargs).loss)


def _gradcheck_micro_batch(f: dict[str, torch.Tensor], inputs_of: Any, kwargs: dict[str, Any]) -> bool:
    """float64 gradcheck of the micro-batch's summed loss wrt the packed log-probs, set close to the inference
    ones (away from the mask and clip boundaries the loss is smooth); ``inputs_of(views, i)``: sample i's inputs."""
    f = {
        **f,
        "lp": (f["inf"] + 0.01 * torch.sin(torch.arange(f["lp"].shape[0], dtype=torch.float64))).clamp(
            max=-0.01
        ),
    }

    def total(lp: torch.Tensor) -> torch.Tensor:
        views = _views({**f, "lp": lp * 1.0})
        losses = [composer_loss(inputs_of(views, i), **kwargs).loss for i in range(len(LENGTHS))]
        return torch.stack(losses).sum()

    lp = f["lp"].clone().requires_grad_(True)
    return bool(torch.autograd.gradcheck(total, (lp,), eps=1e-6, atol=1e-8, rtol=1e-6))


@pytest.mark.parametrize("kwargs", [CONFIGS[1], CONFIGS[2]])
def test_gradcheck_through_packed_views(kwargs) -> None:
    assert _gradcheck_micro_batch(_fields(5), _inputs, kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kwargs", [CONFIGS[0], CONFIGS[4]])
@pytest.mark.parametrize("rl_stream", [False, True], ids=["packed-mask", "rl-stream"])
def test_packed_under_cpu_autocast_is_bit_identical(dtype, kwargs, rl_stream) -> None:
    """An ambient bf16 autocast changes nothing: the metrics' matmul and the backward's product run in full
    precision."""
    f = _rl_fields(6, dtype) if rl_stream else _fields(6, dtype)
    plain = _step(f, kwargs, packed=True, rl_stream=rl_stream)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = _step(f, kwargs, packed=True, rl_stream=rl_stream)
    for x, y in zip(plain[0], cast[0], strict=True):
        assert torch.equal(x.loss, y.loss)
        assert all(torch.equal(x.metrics[k], y.metrics[k]) for k in x.metrics)
        assert all(v.dtype == torch.float32 for v in y.metrics.values())
    assert torch.equal(plain[1], cast[1])
    assert plain[0][0].loss.dtype == dtype


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf, 3e38])
@pytest.mark.parametrize("kwargs", [CONFIGS[1], CONFIGS[4]])
def test_garbage_outside_the_mask_changes_nothing(garbage, kwargs) -> None:
    """Values outside loss_mask are ignored bit for bit (the zeroing is exact, NaN included), in every field.
    The one exception is by design: a sample's ref_logprobs count as real if any token of it, prompt included,
    is non-zero (PRIME-RL's zero fill covers the whole sample), so the zero-filled sample 2 stays all zero."""
    f = _fields(7)
    clean = _step(f, kwargs, packed=True, weighted=True)
    dirty = {k: v.clone() for k, v in f.items()}
    filled = torch.zeros_like(f["mask"])
    filled[sum(LENGTHS[:2]) : sum(LENGTHS[:3])] = True
    for key in ("lp", "inf", "ref", "adv", "w"):
        dirty[key][~f["mask"] & ~(filled if key == "ref" else torch.zeros_like(filled))] = garbage
    _assert_same(_step(dirty, kwargs, packed=True, weighted=True), clean)


# ---- an rl weight stream: every sample's mask is a fresh tensor ------------------------------------------------
# PRIME-RL's orchestrator gives a sample rl weights when it prunes zero-advantage tokens or routes a sample to the
# ce / ref_kl component; the packer then fills the stream (1.0) for every other sample of the micro-batch, and
# compute_loss passes each sample `loss_mask = mask & (rl_weights != 0)` (a new tensor) with `loss_weights =
# rl_weights` (a view). The float fields are still views of the packed tensors: their work is shared.


def _rl_fields(seed: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """A packed micro-batch whose rl weights are 0 on some tokens of the loss mask (pruned) and 1 elsewhere
    (PRIME-RL's fill), with a few non-unit weights."""
    f = _fields(seed, dtype)
    w = torch.ones_like(f["w"])
    w[::3] = 0.0
    w[1::7] = 0.5
    return {**f, "w": w}


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_rl_weight_stream_samples_equal_separate_ones(kwargs) -> None:
    f = _rl_fields(20)
    _assert_same(
        _step(f, kwargs, packed=True, rl_stream=True), _step(f, kwargs, packed=False, rl_stream=True)
    )


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_an_rl_weight_stream_micro_batch_is_computed_once_and_read_once(
    kwargs, monkeypatch, host_reads
) -> None:
    """The per-token work of a micro-batch whose masks are fresh tensors runs once (fails on the main before:
    once per sample, each call on the separate path), and its value checks read the host once (before: once per
    sample)."""
    packs: list[int] = []
    pack = loss_module._pack

    def counting(*args: Any, **kw: Any) -> Any:
        packs.append(1)
        return pack(*args, **kw)

    monkeypatch.setattr(loss_module, "_pack", counting)
    f = _rl_fields(21)
    calls = host_reads()
    _step(f, kwargs, packed=True, rl_stream=True)
    assert len(packs) == 1 and len(calls) <= 1, (packs, calls)


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf, 3e38])
@pytest.mark.parametrize("kwargs", [CONFIGS[1], CONFIGS[4]])
def test_rl_weight_stream_garbage_outside_each_mask_changes_nothing(garbage, kwargs) -> None:
    """Values outside a sample's fresh mask are ignored bit for bit, on tokens outside loss_mask and on tokens
    inside it whose rl weight is 0 (pruned) alike: the micro-batch's one read then fails and each sample is
    checked on its own slice and trains (sample 2's ref_logprobs stay PRIME-RL's zero fill, see above)."""
    f = _rl_fields(22)
    clean = _step(f, kwargs, packed=True, rl_stream=True)
    dirty = {k: v.clone() for k, v in f.items()}
    selected = f["mask"] & (f["w"] != 0)
    filled = torch.zeros_like(selected)
    filled[sum(LENGTHS[:2]) : sum(LENGTHS[:3])] = True
    assert (f["mask"] & ~selected).any()  # some pruned tokens carry garbage too
    for key in ("lp", "inf", "ref", "adv"):
        dirty[key][~selected & ~(filled if key == "ref" else torch.zeros_like(filled))] = garbage
    _assert_same(_step(dirty, kwargs, packed=True, rl_stream=True), clean)


@pytest.mark.parametrize("kwargs", [CONFIGS[1], CONFIGS[4]])
def test_rl_weight_stream_finite_inputs_with_overflowing_terms_outside_each_mask(kwargs) -> None:
    """A finite log-prob of 800 outside every mask: every input is finite (and so is their sum), but e^800
    overflows float64, so the per-token terms there are inf or NaN. The micro-batch's read covers the metric table
    and the derivative too, so those calls zero their whole slice outside the mask (a NaN times 0 is NaN)."""
    f = _rl_fields(25)
    clean = _step(f, kwargs, packed=True, rl_stream=True)
    dirty = {k: v.clone() for k, v in f.items()}
    dirty["lp"][~(f["mask"] & (f["w"] != 0))] = 800.0
    _assert_same(_step(dirty, kwargs, packed=True, rl_stream=True), clean)


def test_rl_weight_stream_bad_value_raises_at_its_own_sample_and_the_others_train() -> None:
    f = _rl_fields(23)
    selected = f["mask"] & (f["w"] != 0)
    bad = int(torch.nonzero(selected[sum(LENGTHS[:2]) : sum(LENGTHS[:3])])[0]) + sum(LENGTHS[:2])
    clean = _step(_rl_fields(23), {}, packed=False, rl_stream=True)[0]
    f["adv"][bad] = math.inf
    _assert_sample_2_raises_and_the_others_train(_views(f), _rl_inputs, clean, "advantages")


@pytest.mark.parametrize("kwargs", [CONFIGS[1], CONFIGS[2]])
def test_gradcheck_through_an_rl_weight_stream(kwargs) -> None:
    assert _gradcheck_micro_batch(_rl_fields(24), _rl_inputs, kwargs)


def test_rl_weight_stream_in_place_change_between_calls_is_seen() -> None:
    """Fresh masks leave the float fields' identity and version counters as the micro-batch's key: an rl weight
    changed in place after the first sample is recomputed, never read stale."""
    f = _rl_fields(26)
    views = _views(f)

    composer_loss(_rl_inputs(views, 0))
    f["w"].mul_(3.0)  # in place: the views see it
    got, want = composer_loss(_rl_inputs(views, 3)).loss, composer_loss(_rl_inputs(views, 3, clone=True)).loss
    torch.testing.assert_close(got, want, rtol=0, atol=0)
