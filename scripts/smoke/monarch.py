# composer-monarch: one step of the GRPO driver (all three channels) on a local Monarch proc mesh.
import torch

installed_from_wheel("composer-core", "composer_core")
installed_from_wheel("composer-monarch", "composer_monarch")
from composer_monarch import ComposerDriver, ComposerLoss, LoopConfig, ReplayRecord, TinyQwen2
from composer_monarch.task import ReverseDigits

task = ReverseDigits(n_digits=8, length=3)
model = TinyQwen2(task.vocab_size, seed=0)
replay = [ReplayRecord(p, task.target(p), 1.0, "oracle") for p in task.prompts(2, step=0)]
loss = ComposerLoss(loss_type="grpo", alpha_sdpo=0.5, beta_replay=0.5, dpo_beta=0.1)
loop = LoopConfig(steps=1, prompts_per_step=2, group_size=4, procs=1, call_timeout_s=240)
with ComposerDriver(task, model, loss=loss, loop=loop, replay=replay) as driver:
    pids = driver.process_ids()
    assert os.getpid() not in pids.values(), pids  # the actors run in the mesh's process, not here
    before = driver.weights()
    (result,) = driver.run(steps=1, progress=False)
    after = driver.weights()
changed = sum(not torch.equal(before[k], after[k]) for k in before)
assert changed == len(before), f"{changed} of {len(before)} tensors changed"
assert result.metrics["composer/sdpo/tokens"] > 0 and result.extra["pairs"] > 0, result.metrics
print(
    f"ok: one driver step on a proc mesh (actor pid {sorted(set(pids.values()))}): all {changed} tensors "
    f"updated, loss {result.metrics.get('composer/loss/total', float('nan')):.4f}, {result.extra['pairs']} replay pairs"
)
