# composer-trl[verifiers]: the README's `--env verifiers:<module>` run with the project's verifiers fixture
# (composer-vf-digits, installed by nox next to the README's command) trains all three channels.
installed_from_wheel("composer-core", "composer_core")
installed_from_wheel("composer-trl", "composer_trl")
importlib.import_module("verifiers")
SMALL = ["--per_device_train_batch_size", "64", "--num_generations", "8", "--max_completion_length", "3"]
out_dir = WORK / "composer-train-verifiers"
log = run(
    BIN / "composer-train", "--env", "verifiers:composer_vf_digits", "--steps", "2", "--output-dir", out_dir,
    "--no-plot", *SMALL, timeout=900,
)  # fmt: skip
rows = [json.loads(x) for x in (out_dir / "metrics-composer.jsonl").read_text().splitlines() if x.strip()]
assert [r["step"] for r in rows] == [1, 2], f"{rows}\n{log[-3000:]}"
for r in rows:
    assert r["composer/loss/sdpo"] > 0 and r["composer/loss/replay"] > 0, r
assert json.loads((out_dir / "summary.json").read_text())["status"] == "finished"
print(
    f"ok: composer-train --env verifiers:composer_vf_digits --steps 2: sdpo and replay > 0 (verifiers {metadata.version('verifiers')})"
)
