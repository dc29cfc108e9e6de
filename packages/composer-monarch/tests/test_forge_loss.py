"""ComposerLoss: the TorchForge loss contract ``loss(logits, **targets)``."""

from __future__ import annotations

import pytest
import torch
from composer_core.loss.compose import ComposerBatch, compose_loss
from composer_monarch.forge_loss import TARGETS, ComposerLoss
from composer_monarch.model import token_logprobs

R, P, S, V = 4, 3, 5, 7


def _forge_targets(
    seed: int = 0, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Full-sequence logits [R, P+S, V] and the targets TorchForge's collate builds."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, P + S, V, generator=g, dtype=dtype)
    response = torch.randint(0, V, (R, S), generator=g)
    mask = torch.ones(R, S, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3, 1:] = False
    return logits, {
        "response": response,
        "ref_logprobs": -torch.rand(R, S, generator=g, dtype=dtype) - 1.0,
        "advantages": torch.randn(R, 1, generator=g, dtype=dtype),
        "padding_mask": mask,
    }


def forge_compute_logprobs(logits, response, temperature=1.0):  # type: ignore[no-untyped-def]
    """TorchForge ``forge.util.ops.compute_logprobs`` written from its steps: slice the positions that
    predict the response, divide by the temperature in the logits' dtype, upcast to float32, −cross-entropy."""
    scaled = (logits[:, -response.shape[1] - 1 : -1] / temperature).float()
    b, s, v = scaled.shape
    return -torch.nn.functional.cross_entropy(
        scaled.reshape(-1, v), response.reshape(-1), reduction="none"
    ).view(b, s)


def forge_simple_grpo(logits, response, ref_logprobs, advantages, padding_mask, beta=0.1, temperature=1.0):  # type: ignore[no-untyped-def]
    """TorchForge ``apps/grpo/main.py::simple_grpo_loss`` written from its formula:
    per token −(exp(ℓ−sg ℓ)·A − β·(exp(ref−ℓ) − (ref−ℓ) − 1)), mean over tokens then over sequences.
    (``simple_grpo_loss`` calls ``compute_logprobs`` at temperature 1; ``temperature`` is its argument.)"""
    lp = forge_compute_logprobs(logits, response, temperature)
    d = ref_logprobs - lp
    per_token = -(torch.exp(lp - lp.detach()) * advantages - beta * (torch.exp(d) - d - 1))
    return ((per_token * padding_mask).sum(1) / padding_mask.sum(1).clamp(min=1)).mean()


def test_equals_torchforge_simple_grpo_loss_value_and_grad() -> None:
    logits, t = _forge_targets(dtype=torch.float32)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ours = ComposerLoss(loss_type="grpo", kl_beta=0.1, alpha_sdpo=0.0, beta_replay=0.0)(a, **t)
    ref = forge_simple_grpo(b, **t)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "temperature", "tol"),
    [
        (torch.float32, 1.0, 1e-6),
        (torch.float32, 0.7, 1e-6),
        (torch.bfloat16, 0.7, 1e-6),
        (torch.bfloat16, 1.3, 1e-6),
    ],
)
def test_bare_constructor_is_torchforge_grpo(dtype: torch.dtype, temperature: float, tol: float) -> None:
    """``ComposerLoss()`` (only the temperature set, as the sampler's) equals TorchForge's GRPO loss on the
    same batch, value and gradient, also with bf16 logits (TorchForge scales before upcasting)."""
    logits, t = _forge_targets(seed=2, dtype=torch.float32)
    logits = (3.0 * logits).to(dtype)
    t = {k: (v.float() if v.is_floating_point() else v) for k, v in t.items()}
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    ours = ComposerLoss(temperature=temperature)(a, **t)
    ref = forge_simple_grpo(b, **t, temperature=temperature)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(ours, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(a.grad, b.grad, atol=tol, rtol=tol)
    assert a.grad.dtype == dtype and float(ref.detach()) > 0.1  # the KL term is on (β = 0.1)
    if dtype == torch.bfloat16:  # the op order is visible in bf16: upcasting first gives another value
        upcast_first = forge_simple_grpo(logits.float() / temperature, **t, temperature=1.0)
        assert abs(float(upcast_first) - float(ref.detach())) > 100 * tol


def test_bare_constructor_defaults() -> None:
    loss = ComposerLoss()
    assert {k: loss.options[k] for k in ("loss_type", "kl_beta", "kl_estimator")} == {
        "loss_type": "grpo",
        "kl_beta": 0.1,
        "kl_estimator": "k3",
    }
    assert loss.needs_reference
    assert not ComposerLoss(kl_beta=0.0, beta_replay=0.0).needs_reference


def test_kl_beta_uses_ref_logprobs_and_without_it_they_are_ignored() -> None:
    logits, t = _forge_targets()
    with_kl = ComposerLoss(loss_type="grpo", kl_beta=0.1)(logits, **t)
    no_kl = ComposerLoss(loss_type="grpo", kl_beta=0.0)(logits, **t)
    no_ref = ComposerLoss(loss_type="grpo", kl_beta=0.0)(
        logits, **{k: v for k, v in t.items() if k != "ref_logprobs"}
    )
    assert not torch.allclose(with_kl, no_kl)
    assert torch.equal(no_kl, no_ref)


def test_equals_compose_loss_on_aligned_inputs() -> None:
    """The callable is exactly compose_loss on the gathered log-probs (channel 1 + 2 full form)."""
    logits, t = _forge_targets()
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(R, S, V, generator=g, dtype=torch.float64)
    old = -torch.rand(R, S, generator=g, dtype=torch.float64) - 0.5
    opts = {"loss_type": "dapo", "kl_beta": 0.0, "alpha_sdpo": 0.7, "sdpo_beta": 0.5, "beta_replay": 0.0}
    ours = ComposerLoss(**opts)(logits, **t, teacher_logits=teacher, old_logprobs=old)
    aligned = logits[:, -S - 1 : -1]
    batch = ComposerBatch(
        logprobs=token_logprobs(aligned, t["response"]),
        advantages=t["advantages"].squeeze(-1),
        completion_mask=t["padding_mask"],
        old_logprobs=old,
        student_logits=aligned,
        teacher_logits=teacher,
        sdpo_mask=t["padding_mask"],
    )
    assert torch.equal(ours, compose_loss(batch, **opts).total)


def test_align_false_takes_aligned_logits() -> None:
    logits, t = _forge_targets()
    full = ComposerLoss(loss_type="grpo")(logits, **t)
    aligned = ComposerLoss(align=False, loss_type="grpo")(logits[:, -S - 1 : -1], **t)
    assert torch.equal(full, aligned)
    with pytest.raises(ValueError, match="align=False"):
        ComposerLoss(align=False)(logits, **t)
    with pytest.raises(ValueError, match="align=True"):
        ComposerLoss()(logits[:, :S], **t)


def test_temperature_scales_logits() -> None:
    logits, t = _forge_targets()
    hot = ComposerLoss(temperature=2.0, loss_type="grpo", kl_beta=0.1)(logits, **t)
    manual = ComposerLoss(loss_type="grpo", kl_beta=0.1)(logits / 2.0, **t)
    cold = ComposerLoss(loss_type="grpo", kl_beta=0.1)(logits, **t)
    torch.testing.assert_close(hot, manual, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(hot, cold)
    with pytest.raises(ValueError, match="temperature"):
        ComposerLoss(temperature=0.0)


def _with_pairs() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rows 0,1 sampled; row 2 = chosen, row 3 = rejected completion of one pair."""
    logits, t = _forge_targets()
    t = dict(t)
    t["advantages"] = torch.tensor([[1.0], [-0.5], [0.0], [0.0]], dtype=torch.float64)
    t["chosen_rows"] = torch.tensor([2])
    t["rejected_rows"] = torch.tensor([3])
    return logits, t


def test_pair_rows_feed_dpo_and_leave_channel_1() -> None:
    logits, t = _with_pairs()
    opts = {"loss_type": "grpo", "kl_beta": 0.0, "alpha_sdpo": 0.0, "beta_replay": 0.5, "dpo_beta": 0.1}
    loss = ComposerLoss(**opts)
    total = loss(logits, **t)
    lp = token_logprobs(logits[:, -S - 1 : -1], t["response"])
    m = t["padding_mask"]
    sums, ref_sums = (lp * m).sum(-1), (t["ref_logprobs"] * m).sum(-1)
    batch = ComposerBatch(
        logprobs=lp[:2],
        advantages=t["advantages"][:2].squeeze(-1),
        completion_mask=m[:2],
        chosen_logps=sums[2:3],
        rejected_logps=sums[3:4],
        ref_chosen_logps=ref_sums[2:3],
        ref_rejected_logps=ref_sums[3:4],
        chosen_lengths=m.sum(-1)[2:3],
        rejected_lengths=m.sum(-1)[3:4],
    )
    expected = compose_loss(batch, **opts)
    assert torch.equal(total, expected.total)
    # closed form of the DPO term: −log σ(β((c − c_ref) − (r − r_ref)))
    margin = 0.1 * ((sums[2] - ref_sums[2]) - (sums[3] - ref_sums[3]))
    torch.testing.assert_close(expected.replay, -torch.nn.functional.logsigmoid(margin))
    assert loss.last_result.metrics["replay/pairs"] == 1.0
    # an explicit policy_rows overrides the default (pair rows excluded)
    all_rows = loss(logits, **t, policy_rows=torch.tensor([True, True, True, True]))
    assert not torch.equal(all_rows, total)


def test_gradcheck_float64_all_three_channels() -> None:
    logits, t = _with_pairs()
    g = torch.Generator().manual_seed(5)
    teacher = torch.randn(R, S, V, generator=g, dtype=torch.float64)
    # explicit old log-probs: with the default (ℓ.detach()) the ratio's value is 1 whatever the logits,
    # so finite differences cannot see the policy-gradient term
    old = -torch.rand(R, S, generator=g, dtype=torch.float64) - 1.0
    # SDPO's IS clip weight is a stop-gradient of ℓθ (core gradchecks the clipped form with ℓθ held fixed)
    loss = ComposerLoss(loss_type="dapo", alpha_sdpo=0.5, beta_replay=0.5, kl_beta=0.05, sdpo_token_clip=None)

    def f(x: torch.Tensor) -> torch.Tensor:
        return loss(x, **t, teacher_logits=teacher, old_logprobs=old)

    assert torch.autograd.gradcheck(
        f, (logits.clone().requires_grad_(True),), eps=1e-6, atol=1e-6, fast_mode=True
    )
    assert (
        loss.last_result.metrics["sdpo/skipped"] == 0.0 and loss.last_result.metrics["replay/skipped"] == 0.0
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"bogus": torch.zeros(1)}, "unknown target"),
        ({"response": None}, "'response' is required"),
        ({"chosen_rows": torch.tensor([1])}, "come together"),
        ({"chosen_rows": torch.tensor([9]), "rejected_rows": torch.tensor([0])}, "index rows"),
        ({"policy_rows": torch.zeros(R, dtype=torch.bool)}, "selects no row"),
        ({"policy_rows": torch.ones(2, dtype=torch.bool)}, "one per row"),
        ({"sdpo_mask": torch.ones(R, S, dtype=torch.bool)}, "without teacher_logits"),
    ],
)
def test_bad_targets_name_the_problem(change: dict[str, object], match: str) -> None:
    logits, t = _forge_targets()
    t = {**t, **change}
    t = {k: v for k, v in t.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        ComposerLoss(loss_type="grpo")(logits, **t)


def test_bad_logits_and_options() -> None:
    logits, t = _forge_targets()
    with pytest.raises(ValueError, match="one row per response"):
        ComposerLoss()(logits[:2], **t)
    with pytest.raises(ValueError, match="unknown compose_loss option"):
        ComposerLoss(epsilon=0.2)
    nan = logits.clone()
    nan[0, -2, 0] = float("nan")
    with pytest.raises(ValueError):
        ComposerLoss(loss_type="grpo")(nan, **t)


def test_targets_are_documented() -> None:
    assert {"response", "ref_logprobs", "advantages", "padding_mask"} <= set(TARGETS)


def test_runs_under_torch_compile_like_titan_trainer() -> None:
    """TitanTrainer wraps its loss in ``torch.compile``. Dynamo must trace ComposerLoss (graph breaks
    are allowed) and give the eager value and gradient. ``aot_eager`` exercises the tracing without
    C++ code generation (the default inductor backend was checked by hand: same value, grad diff 4e-9,
    but it compiles for minutes on a small CPU machine)."""
    logits, t = _with_pairs()
    logits = logits.float()
    t = {k: (v.float() if v.is_floating_point() else v) for k, v in t.items()}
    teacher = torch.randn(R, S, V, generator=torch.Generator().manual_seed(9))
    loss = ComposerLoss(loss_type="grpo", alpha_sdpo=0.5, beta_replay=0.5, kl_beta=0.1)
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager")
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    got = compiled(a, **t, teacher_logits=teacher)
    got.backward()
    assert loss.last_result.metrics["replay/pairs"] == 1.0  # side effects survive compilation
    want = loss(b, **t, teacher_logits=teacher)
    want.backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-6)


def test_config_is_built_once_at_construction_from_core() -> None:
    from composer_core.loss.config import ComposeConfig, SimPO

    loss = ComposerLoss(dpo_variant="simpo", simpo_gamma="0.2", kl_beta=0.1, loss_type="grpo")
    assert loss.config == ComposeConfig.from_flat(
        dpo_variant="simpo", simpo_gamma=0.2, kl_beta=0.1, loss_type="grpo"
    )
    assert loss.config.replay == SimPO(gamma=0.2) and loss.needs_reference  # KL reads the reference
    # an option of an unselected mode is refused when the loss is built, not at the first step
    with pytest.raises(ValueError, match="`simpo_gamma`"):
        ComposerLoss(simpo_gamma=0.2)
    with pytest.raises(ValueError, match="did you mean 'epsilon_low'"):
        ComposerLoss(epsilon_lo=0.2)


# Tensor constructors that place memory: each call in the loss path must say where (device=).
CONSTRUCTORS = {
    "tensor", "as_tensor", "asarray", "arange", "range", "zeros", "ones", "full", "empty", "empty_strided",
    "eye", "linspace", "logspace", "rand", "randn", "randint", "randperm", "scalar_tensor", "tril_indices",
    "triu_indices", "from_numpy",
}  # fmt: skip


def _constructor_calls_without_device(source: str) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        base, name = node.func.value, node.func.attr
        placed = name != "from_numpy" and any(k.arg == "device" for k in node.keywords)
        if isinstance(base, ast.Name) and base.id == "torch" and name in CONSTRUCTORS and not placed:
            found.append(f"line {node.lineno}: torch.{name}")
    return found


def test_loss_path_builds_every_tensor_on_the_input_device() -> None:
    """Every torch constructor in the loss path (forge_loss.py, model.py's log-prob helpers) passes device=."""
    import inspect

    import composer_monarch.forge_loss as forge_loss
    import composer_monarch.model as model

    for module in (forge_loss, model):
        assert _constructor_calls_without_device(inspect.getsource(module)) == [], module.__name__
    # the scan sees what it must catch
    bad = "import torch\nx = torch.ones(3, dtype=torch.bool)\ny = torch.arange(4, device=d)\nz = torch.tensor([1])\n"
    assert _constructor_calls_without_device(bad) == ["line 2: torch.ones", "line 4: torch.tensor"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pairs_and_policy_rows_on_cuda() -> None:
    """Inputs on a non-default device type: every row selection happens on the logits' device."""
    logits, t = _with_pairs()
    cuda = {k: v.cuda() for k, v in t.items()}
    loss = ComposerLoss(alpha_sdpo=0.0, beta_replay=0.5)
    got = loss(logits.cuda(), **cuda)
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), loss(logits, **t), atol=1e-9, rtol=1e-9)


def test_w_policy_zero_is_pure_self_distillation() -> None:
    """w_policy=0 (issue 60): no policy term (and no TorchForge KL default), the loss is α·sdpo of compose_loss."""
    logits, t = _forge_targets()
    teacher = torch.randn(R, S, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    loss = ComposerLoss(w_policy=0.0, alpha_sdpo=0.5, beta_replay=0.0)
    assert loss.config.w_policy == 0.0 and loss.config.policy.kl_beta == 0.0 and not loss.needs_reference
    total = loss(logits, **t, teacher_logits=teacher)
    assert loss.last_result.policy is None and loss.last_result.metrics["policy/skipped"] == 1.0
    both = ComposerLoss(loss_type="grpo", kl_beta=0.0, alpha_sdpo=0.5, beta_replay=0.0)
    both(logits, **t, teacher_logits=teacher)
    assert torch.equal(total, 0.5 * both.last_result.sdpo)
    half = ComposerLoss(w_policy=0.5, loss_type="grpo", kl_beta=0.0, alpha_sdpo=0.5, beta_replay=0.0)
    value = half(logits, **t, teacher_logits=teacher)
    torch.testing.assert_close(value, 0.5 * both.last_result.policy + 0.5 * both.last_result.sdpo)
    with pytest.raises(ValueError, match="all 0"):
        ComposerLoss(w_policy=0.0, alpha_sdpo=0.0, beta_replay=0.0)
