# composer-prime-rl: the shipped example TOMLs load from the installed wheel, their import_path resolves
# to a callable, and that callable computes the loss of one sample (closed form at ratio 1:
# loss = -sum(A * mask), d loss / d trainer_logprobs = -A * mask for both configs).
import importlib.resources
import tomllib

import torch

installed_from_wheel("composer-core", "composer_core")
installed_from_wheel("composer-prime-rl", "composer_prime_rl")
import composer_prime_rl

torch.manual_seed(0)
n = 12
for name in composer_prime_rl.EXAMPLES:
    text = importlib.resources.files("composer_prime_rl").joinpath("examples", name).read_text()
    config = tomllib.loads(text)
    table = config["trainer"]["loss"] if "trainer" in config else config["loss"]
    assert table["type"] == "custom", table
    module, _, attr = table["import_path"].rpartition(".")
    fn = getattr(importlib.import_module(module), attr)
    assert callable(fn), table["import_path"]
    logp = (-torch.rand(n, dtype=torch.float64) - 0.1).requires_grad_(True)
    adv = torch.randn(n, dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.bool)
    mask[:3] = False  # prompt tokens
    inputs = composer_prime_rl.LossInputs(
        trainer_logprobs=logp,
        inference_logprobs=logp.detach().clone(),
        ref_logprobs=logp.detach().clone(),  # the hinted teacher agrees: channel 2 adds 0 at this point
        advantages=adv,
        loss_mask=mask,
    )
    out = fn(inputs, **table.get("kwargs", {}))
    out.loss.backward()
    want = -(adv * mask).sum()
    assert torch.allclose(out.loss.detach(), want, atol=1e-12), (name, out.loss.item(), want.item())
    assert torch.allclose(logp.grad, -(adv * mask), atol=1e-12), name
    print(
        f"ok: {name} -> {table['import_path']}({', '.join(sorted(table.get('kwargs', {})))}): "
        f"loss {out.loss.item():.6f} = -sum(A*mask), gradient = -A*mask, {len(out.metrics)} metrics"
    )
