"""composer_loss against PRIME-RL's own code: ``default_loss_fn``, ``setup_rl_loss_fn``, ``compute_loss``.

prime-rl is not on the package index, so this module runs when either
- ``prime_rl`` is importable (the trainer's own environment), or
- ``PRIME_RL_SRC`` points at a prime-rl checkout (loaded by :mod:`prime_rl_upstream`, beside these tests).
Otherwise it is skipped (the CI case); test_trainer_loop.py then checks the same contract.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from composer_prime_rl import composer_loss
from prime_rl_upstream import UpstreamUnavailable, load_upstream


def _load_upstream() -> tuple[types.ModuleType, types.ModuleType]:
    try:
        return load_upstream()
    except UpstreamUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def upstream() -> tuple[types.ModuleType, types.ModuleType]:
    return _load_upstream()


def _random_sample(upstream_loss: types.ModuleType, seed: int, n: int, weighted: bool) -> Any:
    g = torch.Generator().manual_seed(seed)
    p_inf = torch.rand(n, generator=g, dtype=torch.float64) * 0.9 + 0.05
    p_train = (p_inf + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 0.8).clamp(0.02, 0.98)
    values = {
        "trainer_logprobs": p_train.log().requires_grad_(True),
        "inference_logprobs": p_inf.log(),
        "ref_logprobs": None,
        "teacher_logprobs": None,  # the field's name before PRIME-RL 0be5ac45
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "loss_mask": torch.rand(n, generator=g) > 0.2,
        "loss_weights": torch.rand(n, generator=g, dtype=torch.float64) * 2 if weighted else None,
    }
    names = {f.name for f in dataclasses.fields(upstream_loss.LossInputs)}
    if "loss_weights" not in names and weighted:
        pytest.skip("this PRIME-RL version has no loss_weights")
    return upstream_loss.LossInputs(**{k: v for k, v in values.items() if k in names})


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "knobs", [{}, {"dppo_mask_low": 0.05, "dppo_mask_high": 0.4, "adv_tau": 0.5, "kl_tau": 0.1}]
)
def test_dppo_equals_prime_rl_default_loss_fn(upstream, seed, knobs) -> None:
    loss_mod, configs = upstream
    theirs_in = _random_sample(loss_mod, seed, 40, weighted=seed % 2 == 1)
    ours_in = dataclasses.replace(
        theirs_in, trainer_logprobs=theirs_in.trainer_logprobs.detach().requires_grad_(True)
    )
    theirs = loss_mod.default_loss_fn(theirs_in, configs.DefaultLossConfig(**knobs))
    ours = composer_loss(ours_in, **knobs)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-12, atol=1e-12)
    theirs.loss.backward()
    ours.loss.backward()
    torch.testing.assert_close(
        ours_in.trainer_logprobs.grad, theirs_in.trainer_logprobs.grad, rtol=1e-12, atol=1e-12
    )
    for key, value in theirs.metrics.items():
        torch.testing.assert_close(ours.metrics[key].double(), value.double(), rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("packed", [False, True])
def test_through_prime_rl_setup_and_compute_loss(upstream, packed) -> None:
    """The real trainer path: CustomLossConfig -> setup_rl_loss_fn -> compute_loss per sample. ``packed``: as
    PRIME-RL's train loop calls it, every field a ``[1, N]`` micro-batch tensor split by sequence length (the
    log-probs a non-leaf of the forward)."""
    loss_mod, configs = upstream
    if not hasattr(loss_mod, "setup_rl_loss_fn"):
        pytest.skip("PRIME-RL before 0be5ac45: see test_through_old_prime_rl_setup_loss_fns")
    samples = [_random_sample(loss_mod, 100 + i, n, weighted=False) for i, n in enumerate([7, 12, 5])]
    samples[2].loss_mask[:] = False  # a sample without rl tokens: still called, must give 0
    rl_weights = [torch.rand(s.trainer_logprobs.shape[0], dtype=torch.float64) for s in samples]
    rl_weights[0][0] = 0.0  # weight 0 removes a token from the rl mask
    rl_scale = sum(int((s.loss_mask & (w != 0)).sum()) for s, w in zip(samples, rl_weights, strict=True))
    lengths = [s.trainer_logprobs.shape[0] for s in samples]

    def fields(values: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(torch.cat(values)[None].squeeze().split(lengths)) if packed else values

    def run(loss_config: Any, weights: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
        leaf = torch.cat([s.trainer_logprobs.detach() for s in samples]).requires_grad_(True)
        if packed:  # the forward's [1, N] output, split
            lps = list((leaf[None] * 1.0).squeeze().split(lengths))
        else:
            lps = [lp.clone() for lp in leaf.split(lengths)]
        loss, metrics = loss_mod.compute_loss(
            trainer_logprobs=lps,
            inference_logprobs=fields([s.inference_logprobs for s in samples]),
            ref_logprobs=None,
            advantages=fields([s.advantages for s in samples]),
            loss_mask=fields([s.loss_mask for s in samples]),
            rl_weights=None if weights is None else fields(weights),
            ce_weights=None,
            ref_kl_weights=None,
            rl_loss_fn=loss_mod.setup_rl_loss_fn(loss_config),
            rl_scale=rl_scale,
            ce_scale=1,
            ref_kl_scale=1,
        )
        loss.backward()
        assert leaf.grad is not None
        return loss, leaf.grad, metrics

    custom = configs.CustomLossConfig(import_path="composer_prime_rl.composer_loss", kwargs={"kl_tau": 0.01})
    for weights in (None, rl_weights):
        ours = run(custom, weights)
        theirs = run(configs.DefaultLossConfig(kl_tau=0.01), weights)
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-12)
        assert math.isfinite(ours[0].item())
        for key, value in theirs[2].items():
            torch.testing.assert_close(ours[2][key].double(), value.double(), rtol=1e-5, atol=1e-7, msg=key)


def test_through_old_prime_rl_setup_loss_fns(upstream) -> None:
    """PRIME-RL before 0be5ac45 (teacher_logprobs, no loss_weights): setup_loss_fns + compute_loss."""
    loss_mod, configs = upstream
    if not hasattr(loss_mod, "setup_loss_fns"):
        pytest.skip("PRIME-RL since 0be5ac45: see test_through_prime_rl_setup_and_compute_loss")
    samples = [_random_sample(loss_mod, 200 + i, n, weighted=False) for i, n in enumerate([9, 4, 6])]
    samples[1].loss_mask[:] = False
    scale = sum(int(s.loss_mask.sum()) for s in samples)

    def run(loss_config: Any) -> tuple[torch.Tensor, torch.Tensor]:
        lps = [s.trainer_logprobs.detach().clone().requires_grad_(True) for s in samples]
        loss, _ = loss_mod.compute_loss(
            trainer_logprobs=lps,
            inference_logprobs=[s.inference_logprobs for s in samples],
            teacher_logprobs=None,
            advantages=[s.advantages for s in samples],
            loss_mask=[s.loss_mask for s in samples],
            loss_fns=loss_mod.setup_loss_fns(loss_config),
            loss_scale=scale,
        )
        loss.backward()
        return loss, torch.cat([lp.grad for lp in lps])

    ours = run(configs.CustomLossConfig(import_path="composer_prime_rl.composer_loss", kwargs={}))
    theirs = run(configs.DefaultLossConfig())
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-12)

    # teacher_logprobs feed channel 2 exactly like ref_logprobs do today
    sample = samples[0]
    with_teacher = dataclasses.replace(sample, teacher_logprobs=sample.inference_logprobs - 0.3)
    out = composer_loss(with_teacher, alpha_sdpo=1.0)
    assert out.metrics["composer/sdpo/reverse_kl_k1"].item() == pytest.approx(
        (sample.trainer_logprobs - sample.inference_logprobs + 0.3)[sample.loss_mask].mean().item(), rel=1e-6
    )


_CONTRACT_PROBE = """
import importlib.util, sys, types
spec = importlib.util.spec_from_file_location("_upstream_test", sys.argv[1])
helpers = importlib.util.module_from_spec(spec)
sys.modules["_upstream_test"] = helpers  # dataclasses look their module up in sys.modules
spec.loader.exec_module(helpers)
loss_mod, _ = helpers._load_upstream()
for name in ("prime_rl", "prime_rl.configs", "prime_rl.utils", "prime_rl.trainer", "prime_rl.trainer.rl"):
    sys.modules.setdefault(name, types.ModuleType(name))
sys.modules["prime_rl.trainer.rl.loss"] = loss_mod
for name in [m for m in sys.modules if m.startswith("composer_prime_rl")]:
    del sys.modules[name]  # the helper module imported it before prime_rl existed
import torch
import composer_prime_rl
assert composer_prime_rl.HAS_PRIME_RL
assert composer_prime_rl.LossInputs is loss_mod.LossInputs
assert composer_prime_rl.LossOutputs is loss_mod.LossOutputs
names = {f.name for f in __import__("dataclasses").fields(loss_mod.LossInputs)}
kwargs = dict(trainer_logprobs=torch.tensor([-0.5, -1.0], requires_grad=True),
              inference_logprobs=torch.tensor([-0.6, -0.9]), advantages=torch.tensor([1.0, -1.0]),
              loss_mask=torch.tensor([True, True]))
kwargs["ref_logprobs" if "ref_logprobs" in names else "teacher_logprobs"] = None
out = composer_prime_rl.composer_loss(loss_mod.LossInputs(**kwargs))
assert type(out) is loss_mod.LossOutputs
print("real-contract-ok")
"""


def test_adapter_uses_the_real_classes_when_prime_rl_is_importable(upstream) -> None:
    """In a fresh interpreter where ``prime_rl.trainer.rl.loss`` imports (here: the checkout's
    file), composer_prime_rl re-exports PRIME-RL's own LossInputs / LossOutputs and returns them."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", _CONTRACT_PROBE, __file__],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])},
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "real-contract-ok" in result.stdout
