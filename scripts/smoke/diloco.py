# composer-diloco: one serverless DiLoCo round of two replica processes over a file:// store.
installed_from_wheel("composer-core", "composer_core")
installed_from_wheel("composer-diloco", "composer_diloco")
from composer_diloco import LocalProcessExecutor, run_serverless

results = run_serverless(
    LocalProcessExecutor(WORK / "logs"),
    "composer_diloco.toy:serverless_replica",
    url=f"file://{WORK / 'store'}",
    run_id="smoke",
    world_size=2,
    kwargs={"seed": 0, "max_syncs": 1, "diloco": {"sync_every": 2}},
    timeout_s=300,
)
values = [r.value for r in results]
assert [r.exit_code for r in results] == [0, 0], results
assert values[0]["weights"] == values[1]["weights"], "replicas ended the round with different weights"
assert values[0]["step"] == values[1]["step"] == 1 and values[0]["participants"] == [2], values[0]
print(
    f"ok: 2 replica processes, 1 serverless round over file://: identical weights, participants {values[0]['participants']}"
)
