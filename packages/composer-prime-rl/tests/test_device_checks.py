"""On an accelerator ``composer_loss`` validates without a host sync (PRIME-RL calls it once per packed sample:
a sync per call would drain the stream every sample). The value checks become device asserts that carry the
same messages. On CPU the accelerator path is forced through ``_host_reads_are_free`` and every aten op of
forward + backward is recorded: none may read a value to the host. On CUDA the loss runs under
``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from composer_prime_rl import LossInputs, composer_loss
from composer_prime_rl import inputs as inputs_module
from composer_prime_rl import loss as loss_module
from composer_testkit.host_reads import HOST_READS, RecordOps

CONFIGS = [
    {},
    {"alpha_sdpo": 0.5},
    {"policy_loss": "clipped_surrogate", "epsilon_low": 0.2, "epsilon_high": 0.28, "delta": 1.5},
    {"policy_loss": "clipped_surrogate", "alpha_sdpo": "2.0", "sdpo_token_clip": "3"},  # CLI strings
]


def _sample(device: str, weighted: bool, float_mask: bool, n: int = 48, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    inf = torch.rand(n, generator=g).mul(0.9).add(0.05).log()
    mask = torch.rand(n, generator=g) > 0.2
    x = {
        "lp": inf + torch.randn(n, generator=g) * 0.3,
        "inf": inf,
        "ref": torch.rand(n, generator=g).mul(0.9).add(0.05).log(),
        "adv": torch.randn(n, generator=g),
        "mask": mask.float() if float_mask else mask,
        "w": torch.rand(n, generator=g) + 0.5 if weighted else None,
    }
    return {k: None if v is None else v.to(device) for k, v in x.items()}


def _call(
    x: dict[str, Any], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    lp = x["lp"].clone().requires_grad_(True)
    out = composer_loss(LossInputs(lp, x["inf"], x["ref"], x["adv"], x["mask"], x["w"]), **kwargs)
    out.loss.backward()
    assert lp.grad is not None
    return out.loss.detach(), lp.grad, out.metrics


@pytest.fixture
def accelerator_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs_module, "_host_reads_are_free", lambda device: False)


@pytest.mark.parametrize("kwargs", CONFIGS, ids=["dppo", "dppo+sdpo", "clipped+delta", "clipped+sdpo-cli"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("float_mask", [False, True], ids=["bool-mask", "float-mask"])
def test_accelerator_path_reads_nothing_to_the_host_and_matches_the_cpu_path(
    kwargs: dict[str, Any], weighted: bool, float_mask: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _sample("cpu", weighted, float_mask)
    want = _call(x, kwargs)  # the CPU path (one host read)
    _call(x, kwargs)  # warm the per-run caches (index tensors) as a first step would
    monkeypatch.setattr(inputs_module, "_host_reads_are_free", lambda device: False)
    with RecordOps() as rec:
        got = _call(x, kwargs)
    assert not HOST_READS & set(rec.ops), sorted(HOST_READS & set(rec.ops))
    asserts = rec.ops.count("aten._assert_async.msg")
    assert (
        asserts == 4 + ("alpha_sdpo" in kwargs) + weighted + float_mask
    )  # one per field, mask values, overflow
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys() and all(torch.equal(got[2][k], want[2][k]) for k in want[2])


def test_cpu_path_reads_exactly_one_value_to_the_host() -> None:
    x = _sample("cpu", weighted=True, float_mask=False)
    _call(x, {"alpha_sdpo": 0.5})
    with RecordOps() as rec:
        _call(x, {"alpha_sdpo": 0.5})
    assert sum(op in HOST_READS for op in rec.ops) == 1 and "aten._assert_async.msg" not in rec.ops


@pytest.mark.usefixtures("accelerator_path")
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("adv", float("nan"), "LossInputs.advantages has NaN or inf on tokens selected by loss_mask"),
        ("inf", float("-inf"), "LossInputs.inference_logprobs has NaN or inf"),
        ("ref", float("nan"), "LossInputs.ref_logprobs has NaN or inf"),
        ("w", float("inf"), "LossInputs.loss_weights has NaN or inf"),
        ("mask", 0.5, "LossInputs.loss_mask must be boolean \\(or 0/1\\)"),
        ("adv", 3e38, "so large that their sum over loss_mask overflows torch.float32"),
    ],
)
def test_accelerator_path_asserts_name_the_bad_field(field: str, value: float, match: str) -> None:
    x = _sample("cpu", weighted=True, float_mask=True)
    selected = int(torch.nonzero(x["mask"])[0])
    x[field] = x[field].clone()
    if value == 3e38:
        x[field][x["mask"] > 0] = value  # every field finite, their masked sum is not
    else:
        x[field][selected] = value
    with pytest.raises(RuntimeError, match=match):
        _call(x, {"alpha_sdpo": 0.5})
    x = _sample("cpu", weighted=True, float_mask=True)
    x["adv"] = x["adv"].clone()
    x["adv"][x["mask"] == 0] = float("nan")  # outside the mask: ignored, as on CPU
    assert torch.isfinite(_call(x, {"alpha_sdpo": 0.5})[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kwargs", CONFIGS, ids=["dppo", "dppo+sdpo", "clipped+delta", "clipped+sdpo-cli"])
def test_cuda_loss_runs_under_sync_debug_mode_error(kwargs: dict[str, Any]) -> None:
    samples = [_sample("cuda", weighted=True, float_mask=True, seed=s) for s in range(4)]
    _call(
        samples[0], kwargs
    )  # the first call builds the cached index tensors (one host-to-device copy per run)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [_call(x, kwargs) for x in samples]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for s, (loss, grad, _) in enumerate(got):
        want = _call(_sample("cpu", True, True, seed=s), kwargs)
        # float32 on two devices (other exp/log, other summation order): the loss is a small difference of
        # O(1) per-token terms (|loss| ~ 0.01), so its error is bounded by theirs, a few float32 ulps of 1
        torch.testing.assert_close(loss.cpu(), want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.cpu(), want[1], rtol=1e-5, atol=1e-6)


def _call_packed(
    samples: list[dict[str, Any]], kwargs: dict[str, Any], rl_stream: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor, list[dict[str, torch.Tensor]]]:
    """PRIME-RL's train loop: every field one ``[1, N]`` tensor, each call getting its split views. ``rl_stream``:
    the weights are an rl weight stream, so each call's mask is ``mask & (w != 0)``, a fresh tensor."""
    lengths = [x["lp"].shape[0] for x in samples]
    packed = {k: torch.cat([x[k] for x in samples])[None] for k in samples[0] if samples[0][k] is not None}
    leaf = packed["lp"].clone().requires_grad_(True)
    split = {k: v.squeeze(0).split(lengths) for k, v in {**packed, "lp": leaf * 1.0}.items()}
    if rl_stream:
        split["mask"] = tuple(m & (w != 0) for m, w in zip(split["mask"], split["w"], strict=True))
    fields = ("lp", "inf", "ref", "adv", "mask", "w")
    outs = [
        composer_loss(LossInputs(*(split[k][i] if k in split else None for k in fields)), **kwargs)
        for i in range(len(samples))
    ]
    torch.stack([o.loss for o in outs]).sum().backward()
    assert leaf.grad is not None
    return [o.loss.detach() for o in outs], leaf.grad[0], [o.metrics for o in outs]


@pytest.mark.parametrize("kwargs", CONFIGS, ids=["dppo", "dppo+sdpo", "clipped+delta", "clipped+sdpo-cli"])
def test_accelerator_path_packed_reads_nothing_to_the_host(
    kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed micro-batch: one set of device asserts for all its samples, no host read, CPU-path results."""
    samples = [_sample("cpu", weighted=True, float_mask=True, seed=s) for s in range(4)]
    want = _call_packed(samples, kwargs)
    monkeypatch.setattr(inputs_module, "_host_reads_are_free", lambda device: False)
    with RecordOps() as rec:
        got = _call_packed(samples, kwargs)
    assert not HOST_READS & set(rec.ops), sorted(HOST_READS & set(rec.ops))
    assert rec.ops.count("aten._assert_async.msg") == 6 + ("alpha_sdpo" in kwargs)  # once per micro-batch
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True)) and torch.equal(
        got[1], want[1]
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kwargs", CONFIGS, ids=["dppo", "dppo+sdpo", "clipped+delta", "clipped+sdpo-cli"])
def test_cuda_packed_micro_batch_runs_under_sync_debug_mode_error(kwargs: dict[str, Any]) -> None:
    samples = [_sample("cuda", weighted=True, float_mask=True, seed=s) for s in range(4)]
    _call_packed(samples, kwargs)  # builds the cached index tensors (one host-to-device copy per run)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses, grad, _ = _call_packed(samples, kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _call_packed([_sample("cpu", True, True, seed=s) for s in range(4)], kwargs)
    torch.testing.assert_close(
        torch.stack(losses).cpu(), torch.stack(want[0]), rtol=1e-5, atol=1e-5
    )  # as above
    torch.testing.assert_close(grad.cpu(), want[1], rtol=1e-5, atol=1e-6)


def _rl_samples(device: str) -> list[dict[str, Any]]:
    """Four samples of a micro-batch with an rl weight stream: weight 0 on some loss-mask tokens (pruned)."""
    samples = [_sample(device, weighted=True, float_mask=False, seed=s) for s in range(4)]
    for x in samples:
        x["w"][::4] = 0.0
    return samples


@pytest.mark.parametrize("kwargs", CONFIGS, ids=["dppo", "dppo+sdpo", "clipped+delta", "clipped+sdpo-cli"])
def test_accelerator_path_rl_stream_reads_nothing_to_the_host(
    kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An rl weight stream (fresh masks, float fields packed): the shared work once, each sample's value checks
    as device asserts on its own slice (one per field and the overflow), no host read, CPU-path results."""
    samples = _rl_samples("cpu")
    want = _call_packed(samples, kwargs, rl_stream=True)
    monkeypatch.setattr(inputs_module, "_host_reads_are_free", lambda device: False)
    packs: list[int] = []
    pack = loss_module._pack
    monkeypatch.setattr(loss_module, "_pack", lambda *a, **k: packs.append(1) or pack(*a, **k))
    with RecordOps() as rec:
        got = _call_packed(samples, kwargs, rl_stream=True)
    assert len(packs) == 1  # the micro-batch's shared work (the main before: once per sample)
    assert not HOST_READS & set(rec.ops), sorted(HOST_READS & set(rec.ops))
    fields = 4 + ("alpha_sdpo" in kwargs)  # lp, inf, adv, w (+ ref)
    assert rec.ops.count("aten._assert_async.msg") == len(samples) * (fields + 1)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True)) and torch.equal(
        got[1], want[1]
    )
    for a, b in zip(got[2], want[2], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.usefixtures("accelerator_path")
def test_accelerator_path_rl_stream_asserts_name_the_bad_field_of_its_sample() -> None:
    samples = _rl_samples("cpu")
    pruned = int(torch.nonzero(samples[2]["mask"] & (samples[2]["w"] == 0))[0])
    samples[2]["adv"][pruned] = float("nan")  # in the loss mask but pruned: ignored
    _call_packed(samples, {"alpha_sdpo": 0.5}, rl_stream=True)
    selected = int(torch.nonzero(samples[2]["mask"] & (samples[2]["w"] != 0))[0])
    samples[2]["inf"][selected] = float("inf")
    with pytest.raises(RuntimeError, match=r"LossInputs\.inference_logprobs has NaN or inf"):
        _call_packed(samples, {"alpha_sdpo": 0.5}, rl_stream=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kwargs", CONFIGS, ids=["dppo", "dppo+sdpo", "clipped+delta", "clipped+sdpo-cli"])
def test_cuda_rl_stream_micro_batch_runs_under_sync_debug_mode_error(kwargs: dict[str, Any]) -> None:
    samples = _rl_samples("cuda")
    _call_packed(samples, kwargs, rl_stream=True)  # builds the cached index tensors
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses, grad, _ = _call_packed(samples, kwargs, rl_stream=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _call_packed(_rl_samples("cpu"), kwargs, rl_stream=True)
    torch.testing.assert_close(torch.stack(losses).cpu(), torch.stack(want[0]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.cpu(), want[1], rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("accelerator_path")
@pytest.mark.parametrize("kwargs", CONFIGS, ids=["dppo", "dppo+sdpo", "clipped+delta", "clipped+sdpo-cli"])
def test_accelerator_value_checks_of_a_sample_cost_its_asserts_and_a_few_operators(
    kwargs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU every dispatched operator is a launch (microseconds of host time), and with an rl weight stream
    every call checks its own slice: F + 1 asserts (one per field, the overflow) and 7 operators besides (the
    sum, exact finiteness per field and of the sum, one unbind), where two isfinite, an all and a select per
    field dispatched F + 10 (21 in all for DPPO + SDPO before)."""
    samples = _rl_samples("cpu")
    per_call: list[list[str]] = []
    check = loss_module._check

    def recorded(*args: Any) -> None:
        with RecordOps() as rec:
            check(*args)
        per_call.append(rec.ops)

    monkeypatch.setattr(loss_module, "_check", recorded)
    _call_packed(samples, kwargs, rl_stream=True)
    fields = 4 + ("alpha_sdpo" in kwargs)
    assert len(per_call) == len(samples)
    for ops in per_call:
        assert ops.count("aten._assert_async.msg") == fields + 1
        assert len(ops) <= fields + 1 + 7, ops
