"""``compiled=True`` / ``sdpo_compiled``: the generalized-JSD chunk kernel under ``torch.compile``.

It must compute what the eager kernel computes (value and gradient, every β branch, masks, temperature, bias,
float64 and low-precision inputs under autocast, on the host and the accelerator path), compile once for every
β in (0, 1) and every chunk height, run without a host sync on CUDA, and be refused where it would have no
effect. On the CPU inductor needs a C++ compiler: without one these tests skip (CI's machine has one).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from composer_core import ComposerBatch, compose_loss, fused_linear_generalized_jsd, generalized_jsd
from composer_core.loss import compiled as compiled_module
from composer_core.loss import distill
from composer_core.loss.config import ComposeConfig

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None, reason="inductor's CPU backend needs a C++ compiler"
)
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=_NO_CUDA)]
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 2e-5, "atol": 2e-6}}


def _logits(
    n: int, v: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(device, dtype)
    t = (torch.randn(n, v, generator=g, dtype=torch.float64) * 3).to(device, dtype)
    return s, t


def _value_and_grad(fn: Any, leaves: list[torch.Tensor], **kwargs: Any) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fn(*leaves, **kwargs)
    out.sum().backward()
    return [out.detach(), *(x.grad for x in leaves if x.grad is not None)]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], dtype: torch.dtype) -> None:
    assert len(got) == len(want)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and a.device == e.device
        torch.testing.assert_close(a, e, **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("path", ["host", "accelerator"])
def test_logits_form_equals_the_eager_kernel(
    beta: float, dtype: torch.dtype, device: str, path: str, force_accelerator: Callable[[], None]
) -> None:
    """[2, 19, V] logits, a mask with holes, temperature 1.7, chunks of 8 rows (the last one 6: a shorter chunk)."""
    if path == "accelerator":
        force_accelerator()
    s, t = _logits(38, 257, dtype, device)
    s, t = s.reshape(2, 19, 257), t.reshape(2, 19, 257)
    mask = torch.ones(2, 19, dtype=torch.bool, device=device)
    mask[0, 5:9] = False
    for reduction in ("mean", "none"):
        kw = {"beta": beta, "temperature": 1.7, "mask": mask, "chunk_size": 8, "reduction": reduction}
        want = _value_and_grad(lambda a, kw=kw: generalized_jsd(a, t, **kw), [s])
        got = _value_and_grad(lambda a, kw=kw: generalized_jsd(a, t, compiled=True, **kw), [s])
        _assert_same(got, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_fused_form_equals_the_eager_kernel(beta: float, dtype: torch.dtype, device: str) -> None:
    """Hidden states [3, 11, 24], an LM head with bias over V = 300, chunks of 10 rows (33 rows: 4 chunks)."""
    g = torch.Generator().manual_seed(1)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(device, dtype)  # noqa: E731
    hs, ht, w, b = r(3, 11, 24), r(3, 11, 24), r(300, 24) * 0.5, r(300)
    kw: dict[str, Any] = {"beta": beta, "chunk_size": 10, "temperature": 0.8}

    def run(compiled: bool) -> list[torch.Tensor]:
        return _value_and_grad(
            lambda h, weight, bias: fused_linear_generalized_jsd(
                h, weight, ht, lm_head_bias=bias, compiled=compiled, **kw
            ),
            [hs, w, b],
        )

    _assert_same(run(True), run(False), dtype)


def test_identical_distributions_give_exactly_zero() -> None:
    """f is forced to 0 where log q == log p, as in the eager kernel: value and gradient are exactly 0."""
    s, _ = _logits(12, 100, torch.float32, "cpu")
    for beta in (0.0, 0.5, 1.0):
        got = _value_and_grad(lambda a, beta=beta: generalized_jsd(a, s, beta=beta, compiled=True), [s])
        assert got[0].item() == 0.0 and not got[1].any(), beta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_inputs_under_autocast_compute_in_float32(amp: torch.dtype, device: str) -> None:
    """bf16/fp16 logits under autocast: the compiled kernel computes in float32 like the eager one and returns
    the gradient in the inputs' dtype (each rounds the float32 gradient once: they agree to that rounding)."""
    s, t = _logits(40, 300, amp, device, seed=3)
    with torch.autocast(device_type=device, dtype=amp):
        want = _value_and_grad(lambda a: generalized_jsd(a, t, chunk_size=16), [s])
        got = _value_and_grad(lambda a: generalized_jsd(a, t, chunk_size=16, compiled=True), [s])
    assert got[0].dtype == torch.float32 and got[1].dtype == amp
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_one_compilation_serves_every_interior_beta_and_chunk_height(device: str) -> None:
    """β enters as device scalars and rows are dynamic: after one call, other β in (0, 1), other token counts
    and a shorter last chunk run the same graph (``error_on_recompile`` raises on any recompilation). Only a
    one-row chunk compiles once more (torch specialises sizes 0 and 1)."""
    s, t = _logits(50, 128, torch.float32, device, seed=4)
    generalized_jsd(s, t, beta=0.5, chunk_size=16, compiled=True)  # compiles (rows 16, then dynamic)
    generalized_jsd(s[:7], t[:7], beta=0.5, chunk_size=16, compiled=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for beta, n in ((0.1, 50), (0.9, 34), (0.25, 3), (0.5, 47)):
            want = generalized_jsd(s[:n], t[:n], beta=beta, chunk_size=16)
            got = generalized_jsd(s[:n], t[:n], beta=beta, chunk_size=16, compiled=True)
            torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_the_option_reaches_the_kernel_from_compose_loss_and_cli_strings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``sdpo_compiled="true"`` (a CLI string) runs the compiled kernel in both full forms; the loss equals the
    eager one's; "false" runs the eager kernel."""
    calls: list[float] = []
    real = compiled_module.compiled_jsd_kernel

    def spy(beta: float) -> distill.Kernel:
        calls.append(beta)
        return real(beta)

    monkeypatch.setattr(distill, "compiled_jsd_kernel", spy)  # where jsd_kernel looks it up
    g = torch.Generator().manual_seed(5)
    B, T, V, H = 2, 6, 90, 16
    base = {
        "logprobs": (torch.randn(B, T, generator=g) - 2).requires_grad_(True),
        "advantages": torch.randn(B, generator=g),
        "completion_mask": torch.ones(B, T),
    }
    logits = ComposerBatch(
        **base,
        student_logits=torch.randn(B, T, V, generator=g),
        teacher_logits=torch.randn(B, T, V, generator=g),
    )
    hidden = ComposerBatch(
        **base,
        student_hidden=torch.randn(B, T, H, generator=g),
        teacher_hidden=torch.randn(B, T, H, generator=g),
        lm_head_weight=torch.randn(V, H, generator=g),
    )
    for batch in (logits, hidden):
        values = {}
        for flag in ("true", "false"):
            cfg = ComposeConfig.from_flat(alpha_sdpo=1.0, sdpo_beta="0.4", sdpo_compiled=flag)
            assert cfg.sdpo.compiled is (flag == "true")
            values[flag] = compose_loss(batch, cfg).metrics["loss/sdpo"]
        torch.testing.assert_close(values["true"], values["false"], rtol=2e-5, atol=1e-7)
    assert calls == [0.4, 0.4]


@pytest.mark.parametrize(
    ("options", "form"),
    [
        ({"sdpo_form": "sampled"}, "'sampled'"),
        ({"sdpo_topk": 4}, "'topk'"),
        ({"sdpo_wrapper": "taid", "taid_t": 0.5}, "sdpo_wrapper='taid'"),
        ({"sdpo_wrapper": "entropy_opd"}, "sdpo_wrapper='entropy_opd'"),
    ],
)
def test_the_option_is_refused_where_it_has_no_effect(options: dict[str, object], form: str) -> None:
    with pytest.raises(ValueError, match=r"`sdpo_compiled`=True .*" + form.replace("'", ".")):
        ComposeConfig.from_flat(
            alpha_sdpo=1.0,
            sdpo_compiled=True,
            has_logits=True,
            has_hidden=False,
            has_sampled=False,
            **options,
        )


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_a_non_bool_is_one_line_naming_the_argument(bad: object) -> None:
    s, t = _logits(4, 10, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"^`compiled`=.* must be a bool"):
        generalized_jsd(s, t, compiled=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^`compiled`=.* must be a bool"):
        fused_linear_generalized_jsd(s, torch.ones(3, 10), t, compiled=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`sdpo_compiled`='maybe' .*expected bool"):
        ComposeConfig.from_flat(sdpo_compiled="maybe")


def test_a_compiler_failure_names_the_option_and_the_fix() -> None:
    """inductor's CPU backend pointed at a missing C++ compiler: one RuntimeError naming compiled=False."""
    s, t = _logits(4, 10, torch.float64, "cpu", seed=6)
    torch._dynamo.reset()
    try:
        no_compiler = {"cpp.cxx": ("/nonexistent/c++",), "fx_graph_cache": False}
        message = r"`compiled=True` \(sdpo_compiled\).*compiled=False"
        with torch._inductor.config.patch(no_compiler), pytest.raises(RuntimeError, match=message):
            generalized_jsd(s, t, beta=0.0, compiled=True)
    finally:
        torch._dynamo.reset()


@_NO_CUDA
@pytest.mark.parametrize("kind", ["logits", "hidden"])
def test_cuda_runs_without_a_host_sync(kind: str) -> None:
    """A warm ``compose_loss`` call with ``sdpo_compiled`` under ``set_sync_debug_mode("error")``, value checks
    off and the trainer's tensor token counts, masked rows included: nothing waits for the device, forward or
    backward, and the loss equals the eager kernel's."""
    g = torch.Generator().manual_seed(7)
    B, T, V, H = 4, 16, 512, 32
    r = lambda *shape: torch.randn(*shape, generator=g).cuda()  # noqa: E731
    mask = torch.ones(B, T, device="cuda")
    mask[1, 9:] = 0
    batch = ComposerBatch(logprobs=(r(B, T) - 2).requires_grad_(True), advantages=r(B), completion_mask=mask)
    if kind == "logits":
        batch.student_logits, batch.teacher_logits = (r(B, T, V) * 3).requires_grad_(True), r(B, T, V) * 3
    else:
        batch.student_hidden, batch.teacher_hidden = r(B, T, H).requires_grad_(True), r(B, T, H)
        batch.lm_head_weight = (r(V, H) * 0.3).requires_grad_(True)
    count = {k: torch.tensor(30.0, device="cuda") for k in ("normalizer", "sdpo_normalizer")}

    def run(compiled: bool) -> torch.Tensor:
        cfg = ComposeConfig.from_flat(
            alpha_sdpo=1.0, sdpo_chunk_size=24, sdpo_compiled=compiled, check_values=False
        )
        out = compose_loss(batch, cfg, **count)
        out.total.backward()
        return out.total.detach()

    want = run(False)
    run(True)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run(True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got, want, **TOL[torch.float32])
