"""ComposeConfig: one typed frozen config, the flat facade, coercion, and validation in two tiers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from composer_core import ComposerBatch
from composer_core import compose_loss as core_compose_loss
from composer_core.loss.config import (
    DPO,
    TAID,
    ComposeConfig,
    EntropyOPD,
    PolicyOptions,
    SDPOOptions,
    SimPO,
    coerce_option,
    flat_defaults,
)

ON = {"alpha_sdpo": 1.0, "beta_replay": 1.0}


def compose_loss(batch: ComposerBatch, config: object = None, /, **options: object):  # type: ignore[no-untyped-def]
    """core's ``compose_loss`` with channels 2 and 3 on (weight 1) unless the test sets their weights (core's
    defaults are 0)."""
    if config is None:
        options = {**ON, **options}
    return core_compose_loss(batch, config, **options)  # type: ignore[arg-type]


D = torch.float64
B, T, V, H, P = 3, 4, 7, 5, 2


def _batch(
    *, logits: bool = False, hidden: bool = False, sampled: bool = False, pairs: bool = True
) -> ComposerBatch:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=D)  # noqa: E731
    mask = torch.ones(B, T)
    mask[1, 2:] = 0
    b = ComposerBatch(
        logprobs=(r(B, T) - 2).requires_grad_(True),
        advantages=r(B),
        completion_mask=mask,
        old_logprobs=r(B, T) - 2,
        sdpo_mask=mask.clone(),
    )
    if logits:
        b.student_logits, b.teacher_logits = r(B, T, V).requires_grad_(True), r(B, T, V)
    if hidden:
        b.student_hidden, b.teacher_hidden = r(B, T, H).requires_grad_(True), r(B, T, H)
        b.lm_head_weight = r(V, H).requires_grad_(True)
    if sampled:
        b.teacher_logprobs = r(B, T) - 2
    if pairs:
        b.chosen_logps, b.rejected_logps = (r(P) * 3).requires_grad_(True), (r(P) * 3).requires_grad_(True)
        b.ref_chosen_logps, b.ref_rejected_logps = r(P) * 3, r(P) * 3
        b.chosen_lengths, b.rejected_lengths = torch.tensor([3, 4]), torch.tensor([2, 5])
    return b


# ------------------------------------------------------------------ options without effect raise (form auto-resolved)
@pytest.mark.parametrize(
    ("batch_kw", "option", "value"),
    [
        ({"sampled": True}, "sdpo_beta", 0.0),
        ({"sampled": True}, "sdpo_temperature", 3.0),
        ({}, "rollout_clip_max", 5.0),
        ({}, "rollout_clip_min", 0.1),
        ({}, "dppo_mask_low", 0.05),
        ({}, "dppo_mask_high", 0.3),
        ({}, "kl_estimator", "k1"),
        ({"sampled": True}, "sdpo_chunk_size", 16),
    ],
)
def test_option_without_effect_in_the_resolved_mode_raises(
    batch_kw: dict, option: str, value: object
) -> None:
    b = _batch(**batch_kw)
    with pytest.raises(ValueError, match=f"`{option}`.*silently ignored|silently ignored.*`{option}`"):
        compose_loss(b, **{option: value})


def test_taid_beta_and_topk_chunk_size_raise_instead_of_being_ignored() -> None:
    """Issue 50: under sdpo_wrapper='taid' every sdpo_beta gave the same loss, and sdpo_chunk_size did nothing in
    the top-k form; both now raise, naming the option; their defaults still run."""
    b = _batch(logits=True)
    taid = {"sdpo_wrapper": "taid", "taid_t": 0.5}
    losses = {beta: float(compose_loss(b, **taid, sdpo_beta=beta).sdpo) for beta in (0.5,)}
    assert losses[0.5] > 0
    for beta in (0.0, 0.3, 1.0):
        with pytest.raises(ValueError, match=r"`sdpo_beta`.*taid"):
            compose_loss(b, **taid, sdpo_beta=beta)
    with pytest.raises(ValueError, match=r"`sdpo_chunk_size`=8.*'topk'"):
        compose_loss(b, sdpo_form="topk", sdpo_topk=3, sdpo_chunk_size=8)
    assert compose_loss(b, sdpo_form="topk", sdpo_topk=3).sdpo is not None


def test_sampled_batch_with_default_sdpo_options_still_runs() -> None:
    b = _batch(sampled=True)
    compose_loss(b, sdpo_token_clip=5.0)  # the clip acts in the sampled form
    compose_loss(_batch(logits=True), sdpo_temperature=2.0, sdpo_beta=0.1)


def test_dppo_and_rollout_options_in_their_mode_pass() -> None:
    b = _batch(pairs=False)
    b.inference_logprobs = b.old_logprobs.detach() + 0.1  # type: ignore[union-attr]
    compose_loss(b, rollout_correction="dppo_mask", dppo_mask_low=0.05)
    compose_loss(b, rollout_correction="token_truncate", rollout_clip_max=5.0, rollout_clip_min=0.1)
    with pytest.raises(ValueError, match="`rollout_clip_max`"):
        compose_loss(b, rollout_correction="dppo_mask", rollout_clip_max=5.0)
    with pytest.raises(ValueError, match="`dppo_mask_low`"):
        compose_loss(b, rollout_correction="token_mask", dppo_mask_low=0.05)


def test_every_option_without_effect_is_named_in_one_message() -> None:
    with pytest.raises(ValueError) as err:
        compose_loss(
            _batch(sampled=True),
            sdpo_temperature=3.0,
            kl_estimator="k2",
            simpo_gamma=0.2,
            rollout_clip_min=0.5,
        )
    for name in ("sdpo_temperature", "kl_estimator", "simpo_gamma", "rollout_clip_min"):
        assert f"`{name}`" in str(err.value)


def test_from_flat_without_a_batch_keeps_auto_open() -> None:
    ComposeConfig.from_flat(sdpo_form="auto", sdpo_token_clip=None)
    with pytest.raises(ValueError, match="`kl_estimator`"):
        ComposeConfig.from_flat(kl_estimator="k1")


def test_unknown_option_suggests_the_close_match() -> None:
    with pytest.raises(ValueError, match=r"'simpo_gama' \(did you mean 'simpo_gamma'\?\)"):
        compose_loss(_batch(), simpo_gama=0.1)


# ------------------------------------------------------------------ the typed config cannot express an unselected mode
def test_typed_config_has_no_field_for_an_unselected_mode() -> None:
    with pytest.raises(TypeError):
        DPO(gamma=0.1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        SimPO(loss_type="ipo")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        SDPOOptions(wrapper="taid")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ComposeConfig(replay=TAID())  # type: ignore[arg-type]
    assert not hasattr(SDPOOptions(), "taid_t") and not hasattr(EntropyOPD(), "t")


@pytest.mark.parametrize(
    "build",
    [
        lambda: SDPOOptions(form="sampled", temperature=2.0),
        lambda: SDPOOptions(form="sampled", beta=0.2),
        lambda: SDPOOptions(form="topk", topk=4, wrapper=TAID(t=0.5)),
        lambda: SDPOOptions(form="full", topk=4),
        lambda: PolicyOptions(rollout_clip_max=5.0),
        lambda: PolicyOptions(rollout_correction="token_mask", dppo_mask_high=0.1),
        lambda: PolicyOptions(kl_estimator="k2"),
        lambda: TAID(t=0.5, total_steps=10),
        lambda: ComposeConfig(alpha_sdpo=-1.0),
    ],
)
def test_invalid_combination_raises_at_construction(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


def test_config_is_frozen_and_equals_the_flat_form() -> None:
    cfg = ComposeConfig(
        alpha_sdpo=0.5,
        beta_replay=1.0,
        policy=PolicyOptions(kl_beta=0.0, epsilon_high=0.28),
        sdpo=SDPOOptions(beta=0.3, wrapper=EntropyOPD(threshold=0.5)),
        replay=SimPO(gamma=0.2),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.alpha_sdpo = 1.0  # type: ignore[misc]
    flat = dict(
        alpha_sdpo=0.5, beta_replay=1.0, epsilon_high=0.28, sdpo_beta=0.3, sdpo_wrapper="entropy_opd", entropy_opd_threshold=0.5,
        dpo_variant="simpo", simpo_gamma=0.2,
    )  # fmt: skip
    assert ComposeConfig.from_flat(**flat) == cfg
    b = _batch(logits=True)
    r1, r2 = compose_loss(b, cfg), compose_loss(b, **flat)
    assert torch.equal(r1.total, r2.total)
    assert {k: v for k, v in cfg.to_flat().items() if k in flat} == flat
    with pytest.raises(TypeError, match="not both"):
        compose_loss(b, cfg, alpha_sdpo=1.0)  # type: ignore[misc]


def test_defaults_live_in_the_config_classes() -> None:
    d = flat_defaults()
    assert (
        d["simpo_gamma"] == SimPO().gamma
        and d["dpo_beta"] == DPO().beta
        and d["taid_t_start"] == TAID().t_start
    )
    assert (
        d["sdpo_token_clip"] == SDPOOptions().token_clip and d["epsilon_low"] == PolicyOptions().epsilon_low
    )
    from composer_core.loss.config import flat_option_names

    assert set(flat_option_names()) >= set(d) | {"normalizer", "sdpo_normalizer", "replay_normalizer"}


# ------------------------------------------------------------------ string coercion (options from a CLI)
def test_from_flat_coerces_cli_strings() -> None:
    cfg = ComposeConfig.from_flat(
        alpha_sdpo="0.25", beta_replay="0", epsilon_high="none", max_completion_length="null", loss_type="dapo",
        sdpo_topk="3", sdpo_form="topk", sdpo_token_clip="2.0", check_values="false", dpo_variant="simpo",
        simpo_gamma="0.1",
    )  # fmt: skip
    assert cfg.alpha_sdpo == 0.25 and cfg.beta_replay == 0.0 and cfg.policy.epsilon_high is None
    assert cfg.sdpo.topk == 3 and isinstance(cfg.sdpo.topk, int) and cfg.check_values is False
    assert cfg.replay == SimPO(gamma=0.1)
    for text, want in (
        ("true", True),
        ("1", True),
        ("yes", True),
        ("False", False),
        ("0", False),
        ("no", False),
    ):
        assert coerce_option("check_values", text) is want
    assert coerce_option("sdpo_token_clip", "") is None and coerce_option("rollout_clip_max", "NULL") is None


@pytest.mark.parametrize(
    ("option", "value", "expected"),
    [
        ("alpha_sdpo", "abc", "float"),
        ("alpha_sdpo", True, "float"),
        ("sdpo_topk", "2.5", "int"),
        ("check_values", "maybe", "bool"),
        ("sdpo_form", "fulll", "'auto', 'full', 'topk', 'sampled'"),
        ("dpo_variant", "ipo", "'dpo', 'simpo'"),
        ("kl_beta", "none", "float"),
    ],
)
def test_bad_string_names_the_option_and_the_type(option: str, value: object, expected: str) -> None:
    with pytest.raises(ValueError, match=f"`{option}`") as err:
        ComposeConfig.from_flat(**{option: value})
    assert expected in str(err.value)


# ------------------------------------------------------------------ host syncs per compose_loss call
@contextmanager
def _count_host_reads() -> Iterator[list[str]]:
    calls: list[str] = []
    originals = {}
    for name in ("item", "__bool__", "__float__", "__int__", "__index__", "tolist"):
        orig = getattr(torch.Tensor, name)
        originals[name] = orig

        def wrapper(self: torch.Tensor, *a: object, _orig=orig, _name=name, **k: object) -> object:  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _orig(self, *a, **k)

        setattr(torch.Tensor, name, wrapper)
    try:
        yield calls
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)


_FORMS = {
    "full_logits": ({"logits": True}, {}),
    "fused_hidden": ({"hidden": True}, {}),
    "topk": ({"logits": True}, {"sdpo_topk": 3}),
    "sampled": ({"sampled": True}, {}),
}


@pytest.mark.parametrize("form", sorted(_FORMS))
@pytest.mark.parametrize("variant", ["dpo", "simpo"])
@pytest.mark.parametrize("normalizer", ["local", "tensor"])
def test_compose_loss_reads_the_host_at_most_once(form: str, variant: str, normalizer: str) -> None:
    batch_kw, opts = _FORMS[form]
    b = _batch(**batch_kw)
    if form == "fused_hidden":
        b.lm_head_bias = torch.randn(V, dtype=D)
    norms = {}
    if normalizer == "tensor":
        norms = {
            k: torch.tensor(5.0, dtype=D) for k in ("normalizer", "sdpo_normalizer", "replay_normalizer")
        }
    b.ref_logprobs = b.logprobs.detach() - 0.1
    cfg = ComposeConfig.from_flat(dpo_variant=variant, kl_beta=0.04, **ON, **opts)
    compose_loss(b, cfg, **norms)  # warm-up (imports, caches)
    with _count_host_reads() as on:
        r = compose_loss(b, cfg, **norms)
    with _count_host_reads() as off:
        r_off = compose_loss(b, dataclasses.replace(cfg, check_values=False), **norms)
    with _count_host_reads() as flat:
        compose_loss(b, dpo_variant=variant, kl_beta=0.04, **opts, **norms)
    assert len(on) <= 1, on
    assert off == [], off
    assert len(flat) <= 1, flat
    assert r.sdpo is not None and r.replay is not None
    assert torch.equal(r.total, r_off.total)
    assert r.metrics["loss/total"] == pytest.approx(float(r.total.detach()))  # read only now, on demand
    assert set(r.metrics.tensors()) == set(r.metrics)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"teacher_logits": "nan"}, r"teacher_logits.*NaN"),
        ({"student_logits": "nan"}, r"student_logits.*NaN"),
        ({"completion_mask": "half"}, r"mask.*0/1"),
        ({"sdpo_mask": "zeros"}, r"sdpo_mask.*selects no token"),
        ({"chosen_lengths": "zeros"}, r"chosen_lengths.*> 0"),
        ({"advantages": "inf"}, r"advantages.*NaN/inf"),
    ],
)
def test_bad_values_raise_from_the_fused_check_with_one_sync(change: dict, match: str) -> None:
    b = _batch(logits=True)
    for name, how in change.items():
        t = getattr(b, name).detach()
        bad = {
            "nan": t * float("nan"),
            "inf": t * float("inf"),
            "half": t * 0.5,
            "zeros": torch.zeros_like(t),
        }
        setattr(b, name, bad[how])
    cfg = ComposeConfig.from_flat(dpo_variant="simpo", **ON)
    with _count_host_reads() as calls, pytest.raises(ValueError, match=match):
        compose_loss(b, cfg)
    assert calls[0] == "__bool__"  # the fused read; the rest only builds the message
    compose_loss(b, dataclasses.replace(cfg, check_values=False))  # trusted hot loop: no check


def test_device_mismatch_is_a_structural_error() -> None:
    b = _batch()
    b.advantages = b.advantages.to("meta")
    with pytest.raises(ValueError, match="`advantages` is on meta"):
        compose_loss(b)


def test_the_from_flat_cache_keeps_types_apart() -> None:
    assert ComposeConfig.from_flat(sdpo_topk=1).sdpo.topk == 1
    with pytest.raises(ValueError, match="`sdpo_topk`=True"):
        ComposeConfig.from_flat(sdpo_topk=True)  # 1 == True, but a bool is not an int option


# ------------------------------------------------------------------ chunk size of the full-vocabulary forms
@pytest.mark.parametrize("form", ["full_logits", "fused_hidden"])
def test_sdpo_chunk_size_from_a_cli_string_reaches_the_kernel(form: str, chunk_widths: list[int]) -> None:
    from composer_core.loss import distill

    cfg = ComposeConfig.from_flat(sdpo_chunk_size="2", alpha_sdpo="1.0", beta_replay=1.0)
    assert cfg.sdpo.chunk_size == 2 and isinstance(cfg.sdpo.chunk_size, int)
    assert flat_defaults()["sdpo_chunk_size"] == distill.DEFAULT_CHUNK_SIZE  # one source of the default
    widths = chunk_widths
    flags, _ = _FORMS[form]
    small = compose_loss(_batch(**flags), cfg).total
    assert widths and max(widths) == 2  # every chunk of 2 rows (the last may be shorter)
    widths.clear()
    whole = compose_loss(_batch(**flags), ComposeConfig.from_flat(**ON)).total
    assert max(widths) > 2
    torch.testing.assert_close(small, whole, rtol=1e-12, atol=1e-12)  # exact per chunk: same loss


@pytest.mark.parametrize(
    ("value", "want"), [("none", None), ("", None), (None, None), ("512", 512), (64, 64)]
)
def test_sdpo_chunk_size_is_rows_or_none_for_a_budget_of_logits(value: object, want: int | None) -> None:
    """None (the default; "none"/"" from a CLI or YAML) sizes each chunk's rows by the vocabulary (see
    ``distill.chunk_rows``); an int fixes the rows."""
    assert ComposeConfig.from_flat(sdpo_chunk_size=value).sdpo.chunk_size == want
    assert flat_defaults()["sdpo_chunk_size"] is None


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "abc", True, 0])
def test_invalid_sdpo_chunk_size_names_the_option(value: object) -> None:
    with pytest.raises(ValueError, match="`sdpo_chunk_size`"):
        ComposeConfig.from_flat(sdpo_chunk_size=value)


def test_dpo_label_smoothing_range_per_loss_type_is_checked_at_construction() -> None:
    from composer_core.loss.config import DPO

    assert DPO(label_smoothing=0.5).label_smoothing == 0.5  # cDPO's ε = 0.5 is valid for the sigmoid loss
    for kwargs in ({"label_smoothing": 0.6}, {"loss_type": "robust", "label_smoothing": 0.5},
                   {"loss_type": "ipo", "label_smoothing": 0.1}):  # fmt: skip
        with pytest.raises(ValueError, match="dpo_label_smoothing"):
            DPO(**kwargs)  # type: ignore[arg-type]
