"""The `composer` policy loss against verl's own `vanilla` loss and closed-form channel values."""

from __future__ import annotations

import math

import composer_verl.plugin  # noqa: F401
import pytest
import torch
from composer_core import ADAPTER_PREFIX, METRIC_KEYS
from composer_core.loss.config import DPO, SimPO
from composer_core.loss.distill import sampled_token_distill
from composer_core.loss.preference import dpo_loss, simpo_loss
from composer_verl.batch import ComposerExtras, using_extras
from composer_verl.config import configure
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
BATCH_INFOS = [{}, {"dp_size": 2, "batch_num_tokens": 37, "global_batch_size": 9, "loss_scale_factor": 7}]
LN2 = math.log(2.0)


def _actor_config(**kw: object) -> ActorConfig:
    base: dict[str, object] = {
        "strategy": "fsdp",
        "rollout_n": 1,
        "ppo_micro_batch_size_per_gpu": 2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
    }
    base.update(kw)
    return ActorConfig(**base)


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 6
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3 - 0.1
    # log-ratios spread over both clip regions and past the dual-clip bound (ρ up to e^1.6 ≈ 5)
    delta = (torch.rand(b, t, generator=g, dtype=torch.float64) - 0.5) * 3.2
    logp = (old + delta).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=torch.float64)[:, None].expand(b, t).clone()
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 1:] = False
    mask[4, :] = False  # a fully masked row (excluded by verl's seq-mean modes)
    return {"old_log_prob": old, "log_prob": logp, "advantages": adv, "response_mask": mask}


def _run(name: str, inputs: dict[str, torch.Tensor], mode: str, config: ActorConfig, **kw: object):
    fn = get_policy_loss_fn(name)
    loss, metrics = fn(loss_agg_mode=mode, config=config, **inputs, **kw)
    (grad,) = torch.autograd.grad(loss, inputs["log_prob"])
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("info", BATCH_INFOS, ids=["local", "global"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_is_weights", [False, True])
def test_alpha_beta_zero_equals_verl_vanilla(mode: str, info: dict[str, int], with_is_weights: bool) -> None:
    config = _actor_config()
    config.global_batch_info.update(info)
    inputs = _inputs()
    kw = {}
    if with_is_weights:
        kw["rollout_is_weights"] = torch.rand(inputs["log_prob"].shape, dtype=torch.float64) + 0.5
    ours, g_ours, m_ours = _run("composer", inputs, mode, config, **kw)
    ref, g_ref, m_ref = _run("vanilla", inputs, mode, config, **kw)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-12)
    assert g_ref.abs().sum() > 0
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert m_ours[key] == pytest.approx(m_ref[key], abs=1e-7), key  # verl counts in float32
    assert 0 < m_ref["actor/pg_clipfrac"] < 1 and m_ref["actor/pg_clipfrac_lower"] > 0  # both clips exercised


def test_global_batch_info_is_honoured() -> None:
    """The same micro-batch gives a different value when verl says the global batch is larger."""
    inputs = _inputs()
    local = _run("composer", inputs, "token-mean", _actor_config())[0]
    config = _actor_config()
    config.global_batch_info.update(
        {"dp_size": 1, "batch_num_tokens": 2 * int(inputs["response_mask"].sum())}
    )
    torch.testing.assert_close(_run("composer", inputs, "token-mean", config)[0], local / 2)


def test_clip_ratio_c_dual_clip_closed_form() -> None:
    # one token, ρ = 5, A = -1: PPO gives max(5, 0.8)=5, dual clip caps it at c = 3 (verl's clip_ratio_c)
    one = {
        "old_log_prob": torch.zeros(1, 1, dtype=torch.float64),
        "log_prob": torch.full((1, 1), math.log(5.0), dtype=torch.float64, requires_grad=True),
        "advantages": -torch.ones(1, 1, dtype=torch.float64),
        "response_mask": torch.ones(1, 1, dtype=torch.bool),
    }
    assert _run("composer", one, "token-mean", _actor_config())[0].item() == pytest.approx(3.0)
    assert _run("composer", one, "token-mean", _actor_config(clip_ratio_c=4.0))[0].item() == pytest.approx(
        4.0
    )
    configure({"policy_delta": 2.0})  # TRL two-sided clip caps ρ at δ before the dual clip
    assert _run("composer", one, "token-mean", _actor_config())[0].item() == pytest.approx(2.0)


def test_gradcheck_policy_and_replay_channels() -> None:
    configure({"beta_replay": 0.7})
    inputs = _inputs()
    mask = inputs["response_mask"].clone()
    mask[4, :2] = True  # rows 0/1 and 2/4 form pairs below; every row needs response tokens
    extras = ComposerExtras(
        pref_pair_id=torch.tensor([0, 0, 1, -1, 1]),
        pref_chosen=torch.tensor([1, 0, 0, 0, 1]),
        pref_ref_log_prob=torch.tensor([-3.0, -2.5, -1.0, 0.0, -4.0], dtype=torch.float64),
    )
    config = _actor_config()
    fn = get_policy_loss_fn("composer")

    def f(logp: torch.Tensor) -> torch.Tensor:
        with using_extras(extras):
            return fn(
                old_log_prob=inputs["old_log_prob"],
                log_prob=logp,
                advantages=inputs["advantages"],
                response_mask=mask,
                loss_agg_mode="seq-mean-token-mean",
                config=config,
            )[0]

    assert torch.autograd.gradcheck(f, (inputs["log_prob"].detach().clone().requires_grad_(True),))


# --- channel 2: SDPO on sampled tokens --------------------------------------------------------------------


def _on_policy(b: int = 2, t: int = 3) -> dict[str, torch.Tensor]:
    logp = torch.full((b, t), math.log(0.5), dtype=torch.float64, requires_grad=True)
    return {
        "old_log_prob": logp.detach().clone(),
        "log_prob": logp,
        "advantages": torch.zeros(b, t, dtype=torch.float64),  # policy term 0: isolate the channel
        "response_mask": torch.ones(b, t, dtype=torch.bool),
    }


def test_sdpo_closed_form_value_and_gradient() -> None:
    """p_S = 0.5, p_T = 0.25 on every sampled token: value ln 2, gradient coefficient +ln 2 / N."""
    configure({"alpha_sdpo": 0.5})
    inputs = _on_policy()
    sdpo_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    extras = ComposerExtras(
        teacher_log_probs=torch.full((2, 3), math.log(0.25), dtype=torch.float64), sdpo_mask=sdpo_mask
    )
    with using_extras(extras):
        loss, grad, metrics = _run("composer", inputs, "token-mean", _actor_config())
    assert loss.item() == pytest.approx(0.5 * LN2)
    assert metrics["composer/loss/sdpo"] == pytest.approx(LN2) and metrics["composer/sdpo/tokens"] == 3.0
    torch.testing.assert_close(grad, 0.5 * LN2 / 3 * sdpo_mask.double())


def test_sdpo_uses_the_global_token_count() -> None:
    configure({"alpha_sdpo": 1.0})
    inputs = _on_policy()
    teacher = torch.full((2, 3), math.log(0.25), dtype=torch.float64)
    extras = ComposerExtras(
        teacher_log_probs=teacher, sdpo_mask=torch.ones(2, 3), global_sdpo_tokens=24.0, dp_size=2
    )
    with using_extras(extras):
        loss = _run("composer", inputs, "token-mean", _actor_config())[0]
    assert loss.item() == pytest.approx(6 * LN2 / (24 / 2))


def test_sdpo_token_clip_reaches_core() -> None:
    configure({"alpha_sdpo": 1.0, "sdpo_token_clip": 1.5})
    inputs = _on_policy()
    inputs["old_log_prob"] = inputs["old_log_prob"] - 1.0  # ρ = e ≈ 2.72 > 2 (default clip) > 1.5
    teacher = torch.full((2, 3), math.log(0.25), dtype=torch.float64)
    extras = ComposerExtras(teacher_log_probs=teacher, sdpo_mask=torch.ones(2, 3))
    with using_extras(extras):
        metrics = _run("composer", inputs, "token-mean", _actor_config())[2]
    assert metrics["composer/loss/sdpo"] == pytest.approx(1.5 * LN2)
    expected = sampled_token_distill(
        inputs["log_prob"], teacher, torch.ones(2, 3), old_logprobs=inputs["old_log_prob"], is_clip=1.5
    )
    assert metrics["composer/loss/sdpo"] == pytest.approx(expected.item())


def test_sdpo_enabled_without_extension_raises() -> None:
    configure({"alpha_sdpo": 0.5})
    with pytest.raises(ValueError, match="actor extension"):
        _run("composer", _on_policy(), "token-mean", _actor_config())


def test_sdpo_enabled_with_missing_keys_raises() -> None:
    configure({"alpha_sdpo": 0.5})
    with (
        using_extras(ComposerExtras(sdpo_mask=torch.ones(2, 3))),
        pytest.raises(ValueError, match="composer_teacher_log_probs"),
    ):
        _run("composer", _on_policy(), "token-mean", _actor_config())


def test_sdpo_shape_mismatch_raises() -> None:
    configure({"alpha_sdpo": 0.5})
    extras = ComposerExtras(
        teacher_log_probs=torch.zeros(2, 4, dtype=torch.float64), sdpo_mask=torch.ones(2, 3)
    )
    with using_extras(extras), pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        _run("composer", _on_policy(), "token-mean", _actor_config())


def test_sdpo_keys_ignored_when_alpha_zero() -> None:
    inputs = _on_policy()
    extras = ComposerExtras(
        teacher_log_probs=torch.zeros(2, 3, dtype=torch.float64), sdpo_mask=torch.ones(2, 3)
    )
    with using_extras(extras):
        loss, _, metrics = _run("composer", inputs, "token-mean", _actor_config())
    assert loss.item() == 0.0 and "composer/loss/sdpo" not in metrics


# --- channel 3: trace-replay preference -------------------------------------------------------------------

PAIRS = {"pref_pair_id": torch.tensor([0, 0, -1, 1, 1]), "pref_chosen": torch.tensor([1, 0, 0, 0, 1])}


def _pref_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    logp = (-torch.rand(5, 4, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    mask = torch.ones(5, 4, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3, 2:] = False
    return {
        "old_log_prob": logp.detach().clone(),
        "log_prob": logp,
        "advantages": torch.zeros(5, 4, dtype=torch.float64),
        "response_mask": mask,
    }


def test_dpo_at_init_is_ln2_per_pair() -> None:
    configure({"beta_replay": 0.3})
    inputs = _pref_inputs()
    ref_seq = (inputs["log_prob"].detach() * inputs["response_mask"]).sum(-1)  # policy == reference
    with using_extras(ComposerExtras(**PAIRS, pref_ref_log_prob=ref_seq)):
        loss, _, metrics = _run("composer", inputs, "token-mean", _actor_config())
    assert loss.item() == pytest.approx(0.3 * LN2)
    assert metrics["composer/replay/pairs"] == 2.0


def test_dpo_reference_from_verl_ref_log_prob() -> None:
    configure({"beta_replay": 1.0})
    inputs = _pref_inputs()
    with using_extras(ComposerExtras(**PAIRS, ref_log_prob=inputs["log_prob"].detach() - 0.1)):
        loss = _run("composer", inputs, "token-mean", _actor_config())[0]
    mask = inputs["response_mask"].double()
    seq = (inputs["log_prob"].detach() * mask).sum(-1)
    ref = ((inputs["log_prob"].detach() - 0.1) * mask).sum(-1)
    expected = dpo_loss(seq[[0, 4]], seq[[1, 3]], ref[[0, 4]], ref[[1, 3]])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert expected.item() != pytest.approx(LN2)  # lengths differ, so the reference matters


@pytest.mark.parametrize(
    "options",
    [
        {"dpo_beta": 0.5},
        {"dpo_loss_type": "robust", "dpo_label_smoothing": 0.2},
        {"dpo_loss_type": "ipo"},
        {"dpo_label_smoothing": 0.1},
        {"rpo_alpha": 0.5},
        {"dpo_loss_type": "ipo", "rpo_alpha": 0.5},
    ],
)
def test_dpo_options_reach_core(options: dict[str, object]) -> None:
    inputs = _pref_inputs()
    mask = inputs["response_mask"].double()
    seq = (inputs["log_prob"].detach() * mask).sum(-1)
    ref = seq.flip(0) * 0.5
    lengths = mask.sum(-1)

    def ours(opts: dict[str, object]) -> float:
        configure({"beta_replay": 1.0, **opts})
        with using_extras(ComposerExtras(**PAIRS, pref_ref_log_prob=ref)):
            return _run("composer", inputs, "token-mean", _actor_config())[0].item()

    core = DPO(**{k.removeprefix("dpo_"): v for k, v in options.items()})  # type: ignore[arg-type]
    ipo = core.loss_type == "ipo"
    lens = {"chosen_lengths": lengths[[0, 4]], "rejected_lengths": lengths[[1, 3]]} if ipo else {}
    if core.rpo_alpha and not ipo:  # RPO's NLL of the chosen side, by hand: alpha * mean(-l_c / |c|)
        plain = dpo_loss(seq[[0, 4]], seq[[1, 3]], ref[[0, 4]], ref[[1, 3]])
        nll = (-seq[[0, 4]] / lengths[[0, 4]]).mean()
        assert ours(options) == pytest.approx((plain + core.rpo_alpha * nll).item(), rel=1e-12)
        lens = {"chosen_lengths": lengths[[0, 4]]}
    expected = dpo_loss(seq[[0, 4]], seq[[1, 3]], ref[[0, 4]], ref[[1, 3]], options=core, **lens)
    assert ours(options) == pytest.approx(expected.item(), rel=1e-12)
    assert ours(options) != pytest.approx(ours({}), rel=1e-6)


@pytest.mark.parametrize("options", [{}, {"simpo_beta": 1.0}, {"simpo_gamma": 0.0}])
def test_simpo(options: dict[str, object]) -> None:
    configure({"beta_replay": 1.0, "dpo_variant": "simpo", **options})
    inputs = _pref_inputs()
    with using_extras(ComposerExtras(**PAIRS)):  # SimPO needs no reference
        loss = _run("composer", inputs, "token-mean", _actor_config())[0]
    mask = inputs["response_mask"].double()
    seq, lengths = (inputs["log_prob"].detach() * mask).sum(-1), mask.sum(-1)
    beta, gamma = options.get("simpo_beta", 2.0), options.get("simpo_gamma", 0.5)
    margin = beta * (seq[[0, 4]] / lengths[[0, 4]] - seq[[1, 3]] / lengths[[1, 3]]) - gamma
    closed_form = -torch.nn.functional.logsigmoid(margin).mean()
    assert loss.item() == pytest.approx(closed_form.item(), rel=1e-12)
    core = simpo_loss(
        seq[[0, 4]], seq[[1, 3]], lengths[[0, 4]], lengths[[1, 3]], options=SimPO(beta=beta, gamma=gamma)
    )
    assert loss.item() == pytest.approx(core.item(), rel=1e-12)


def test_replay_uses_global_pair_count() -> None:
    configure({"beta_replay": 1.0})
    inputs = _pref_inputs()
    ref_seq = (inputs["log_prob"].detach() * inputs["response_mask"]).sum(-1)
    with using_extras(ComposerExtras(**PAIRS, pref_ref_log_prob=ref_seq, global_pref_pairs=8.0, dp_size=2)):
        loss = _run("composer", inputs, "token-mean", _actor_config())[0]
    assert loss.item() == pytest.approx(2 * LN2 / 4)


def test_incomplete_pair_raises() -> None:
    configure({"beta_replay": 1.0, "dpo_variant": "simpo"})
    extras = ComposerExtras(
        pref_pair_id=torch.tensor([0, 0, -1, 1, -1]), pref_chosen=torch.tensor([1, 0, 0, 1, 0])
    )
    with using_extras(extras), pytest.raises(ValueError, match="composer_pref_pair_id=1"):
        _run("composer", _pref_inputs(), "token-mean", _actor_config())


def test_dpo_without_reference_raises() -> None:
    configure({"beta_replay": 1.0})
    with using_extras(ComposerExtras(**PAIRS)), pytest.raises(ValueError, match="reference log-probs"):
        _run("composer", _pref_inputs(), "token-mean", _actor_config())


def test_replay_enabled_with_missing_keys_raises() -> None:
    configure({"beta_replay": 1.0})
    with using_extras(ComposerExtras()), pytest.raises(ValueError, match="composer_pref_pair_id"):
        _run("composer", _pref_inputs(), "token-mean", _actor_config())
    with pytest.raises(ValueError, match="actor extension"):
        _run("composer", _pref_inputs(), "token-mean", _actor_config())


def test_channels_add_up() -> None:
    configure({"alpha_sdpo": 0.5, "beta_replay": 0.25})
    inputs = _pref_inputs()
    teacher = inputs["log_prob"].detach() - LN2
    ref_seq = (inputs["log_prob"].detach() * inputs["response_mask"]).sum(-1)
    extras = ComposerExtras(
        **PAIRS, pref_ref_log_prob=ref_seq, teacher_log_probs=teacher, sdpo_mask=torch.ones(5, 4)
    )
    with using_extras(extras):
        loss, _, m = _run("composer", inputs, "token-mean", _actor_config())
    assert m["composer/loss/sdpo"] == pytest.approx(LN2) and m["composer/loss/replay"] == pytest.approx(LN2)
    assert loss.item() == pytest.approx(m["composer/loss/policy"] + 0.5 * LN2 + 0.25 * LN2)
    # composer-core's metric keys under composer/ (verl logs channel 1 under its own actor/* names)
    logged = {k for k in m if k.startswith(ADAPTER_PREFIX)}
    core = {"loss/policy", "loss/sdpo", "loss/replay", "sdpo/tokens", "replay/pairs"}
    assert core <= set(METRIC_KEYS) and logged == {ADAPTER_PREFIX + k for k in core}
    assert {k for k in m if not k.startswith(ADAPTER_PREFIX)} <= {k for k in m if k.startswith("actor/")}


@pytest.mark.parametrize(
    ("field", "value", "key"),
    [
        ("pref_ref_log_prob", torch.zeros(5, 4, dtype=torch.float64), "composer_pref_ref_log_prob"),
        ("pref_pair_id", torch.tensor([0, 0, -1, 1, 1, -1]), "composer_pref_pair_id"),
        ("pref_chosen", torch.ones(5, 2), "composer_pref_chosen"),
    ],
)
def test_preference_key_with_wrong_shape_raises(field: str, value: torch.Tensor, key: str) -> None:
    configure({"beta_replay": 1.0})
    inputs = _pref_inputs()
    ref_seq = (inputs["log_prob"].detach() * inputs["response_mask"]).sum(-1)
    extras = ComposerExtras(**{**PAIRS, "pref_ref_log_prob": ref_seq, field: value})
    with using_extras(extras), pytest.raises(ValueError, match=rf"{key}'\] has shape .*expected \(5,\)"):
        _run("composer", inputs, "token-mean", _actor_config())


def test_pairs_are_read_to_the_host_once_whatever_their_number(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's micro-batch lives on the GPU, where every read of a value to the host is a sync. Channel 3 finds
    its pairs with one read of the two pair columns (one ``tolist``), not a ``unique``, then a ``nonzero`` and
    two reads per pair; the loss equals the closed form's pairing."""
    from composer_testkit.host_reads import RecordOps
    from composer_verl.config import current_config
    from composer_verl.policy_loss import replay_term

    configure({"beta_replay": 1.0, "dpo_variant": "simpo"})
    b = 8  # pairs 2, 0, 1 (in that row order), two unpaired rows
    pair_id = torch.tensor([2, 0, -1, 1, 0, 2, -1, 1])
    chosen = torch.tensor([0, 1, 0, 1, 0, 1, 1, 0])
    g = torch.Generator().manual_seed(4)
    logp = -torch.rand(b, 3, generator=g, dtype=torch.float64)
    mask = torch.ones(b, 3, dtype=torch.bool)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    extras = ComposerExtras(pref_pair_id=pair_id, pref_chosen=chosen)
    with RecordOps() as rec:
        loss, metrics = replay_term(logp, mask, extras, current_config())
    assert not {"aten.nonzero.default", "aten._unique2.default"} & set(rec.ops)
    assert reads == [(2, b)]
    assert metrics == {"composer/replay/pairs": 3.0}
    seq, n = logp.sum(-1), mask.sum(-1).double()
    ci, ri = [1, 3, 5], [4, 7, 0]  # pairs 0, 1, 2: chosen and rejected rows
    want = simpo_loss(seq[ci], seq[ri], n[ci], n[ri], options=SimPO(beta=2.0, gamma=0.5))
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)


def test_the_three_channels_value_checks_are_one_host_read() -> None:
    """The core losses behind the three channels check their inputs (finite values, masks): 11 checks here.
    Inside the composer policy loss they are fused into one read, so a call reads the host 8 times: that read,
    the SDPO token count, and six metric values read from tensors (18 times before: each check read on its own)."""
    from composer_testkit.host_reads import HOST_READS, RecordOps

    configure({"alpha_sdpo": 0.5, "beta_replay": 0.25})
    inputs = _pref_inputs()
    teacher = inputs["log_prob"].detach() - LN2
    ref_seq = (inputs["log_prob"].detach() * inputs["response_mask"]).sum(-1)
    extras = ComposerExtras(
        **PAIRS, pref_ref_log_prob=ref_seq, teacher_log_probs=teacher, sdpo_mask=torch.ones(5, 4)
    )
    with using_extras(extras), RecordOps() as rec:
        _, metrics = get_policy_loss_fn("composer")(
            loss_agg_mode="token-mean", config=_actor_config(), **inputs
        )
    assert len([op for op in rec.ops if op in HOST_READS]) == 8
    assert len([v for v in metrics.values() if isinstance(v, float)]) == len(metrics) == 8
    # and a failing check still raises its own message
    bad = {**inputs, "old_log_prob": inputs["old_log_prob"].clone()}
    bad["old_log_prob"][0, 0] = float("nan")
    with using_extras(extras), pytest.raises(ValueError, match="NaN"):
        get_policy_loss_fn("composer")(loss_agg_mode="token-mean", config=_actor_config(), **bad)


# Tensor constructors that place memory: each call in the policy loss must say where (device=), so that a GPU
# micro-batch is never indexed by host tensors (an implicit copy at every use).
CONSTRUCTORS = {
    "tensor", "as_tensor", "asarray", "arange", "range", "zeros", "ones", "full", "empty", "empty_strided",
    "eye", "linspace", "logspace", "rand", "randn", "randint", "randperm", "scalar_tensor", "from_numpy",
}  # fmt: skip


def test_policy_loss_builds_every_tensor_on_the_batch_device() -> None:
    import ast
    import inspect

    import composer_verl.policy_loss as policy_loss

    found = []
    for node in ast.walk(ast.parse(inspect.getsource(policy_loss))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base, name = node.func.value, node.func.attr
            placed = name != "from_numpy" and any(k.arg == "device" for k in node.keywords)
            if isinstance(base, ast.Name) and base.id == "torch" and name in CONSTRUCTORS and not placed:
                found.append(f"line {node.lineno}: torch.{name}")
    assert found == []


def test_w_policy_weights_channel_1_and_zero_skips_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """total = w_policy·policy + α·sdpo (issue 60); w_policy=0 never computes channel 1 (pure self-distillation)."""
    import composer_verl.policy_loss as module

    inputs = _inputs(3)
    teacher = inputs["log_prob"].detach() - 0.4
    extras = ComposerExtras(teacher_log_probs=teacher, sdpo_mask=inputs["response_mask"])
    parts = {}
    for w in (1.0, 0.25, 0.0):
        configure({"alpha_sdpo": 0.5, "w_policy": w})
        with using_extras(extras):
            parts[w] = _run("composer", inputs, "token-mean", _actor_config())
    policy, sdpo = parts[1.0][2]["composer/loss/policy"], parts[1.0][2]["composer/loss/sdpo"]
    assert parts[0.25][0].item() == pytest.approx(0.25 * policy + 0.5 * sdpo, rel=1e-12)
    assert parts[0.0][0].item() == pytest.approx(0.5 * sdpo, rel=1e-12)
    assert parts[0.0][2]["composer/policy/skipped"] == 1.0 and "composer/loss/policy" not in parts[0.0][2]

    def boom(*a: object, **k: object) -> None:
        raise AssertionError("channel 1 computed under w_policy=0")

    monkeypatch.setattr(module, "channel1_per_token", boom)
    with using_extras(extras):
        assert torch.equal(_run("composer", inputs, "token-mean", _actor_config())[0], parts[0.0][0])
    with pytest.raises(ValueError, match="all 0: nothing to train"):
        configure({"w_policy": 0.0})


def test_sdpo_topk_takes_the_is_clip() -> None:
    """The top-k form's per-token divergence (the actor's) is weighted by core's clipped IS ratio, as the sampled
    form is (issue 60: TRL SDPOTrainer applies distillation_is_clip on every form)."""
    from composer_core.loss.distill import is_clip_weight

    inputs = _inputs(4)
    per_token = torch.rand(
        inputs["log_prob"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    extras = ComposerExtras(sdpo_topk=per_token, sdpo_mask=inputs["response_mask"])
    mask = inputs["response_mask"]
    out = {}
    for clip in (1.2, None):
        configure({"alpha_sdpo": 1.0, "sdpo_form": "topk", "sdpo_topk": 3, "sdpo_token_clip": clip})
        with using_extras(extras):
            out[clip] = _run("composer", inputs, "token-mean", _actor_config())[2]["composer/loss/sdpo"]
    w = is_clip_weight(inputs["log_prob"], inputs["old_log_prob"], 1.2)
    assert w is not None and (w == 1.2).any() and (w < 1.0).any()
    assert out[1.2] == pytest.approx(((per_token * w)[mask].sum() / mask.sum()).item(), rel=1e-12)
    assert out[None] == pytest.approx((per_token[mask].sum() / mask.sum()).item(), rel=1e-12)
