# composer-trl: the main job `composer-train --steps 2` trains and writes its outputs.
installed_from_wheel("composer-core", "composer_core")
installed_from_wheel("composer-trl", "composer_trl")
out_dir = WORK / "composer-train"
log = run(BIN / "composer-train", "--steps", "2", "--output-dir", out_dir, timeout=900)
summary = json.loads((out_dir / "summary.json").read_text())
assert summary["steps"] == 2 and "composer" in summary, summary
rows = [
    json.loads(line) for line in (out_dir / "metrics-composer.jsonl").read_text().splitlines() if line.strip()
]
assert len(rows) >= 2, rows
for leaf in ("metrics.png", "model/config.json"):
    assert (out_dir / leaf).is_file(), f"composer-train did not write {leaf}:\n{log[-3000:]}"
assert any((out_dir / "model").glob("*.safetensors")), "no model weights written"
print(
    f"ok: composer-train --steps 2 wrote summary.json, metrics-composer.jsonl ({len(rows)} rows), metrics.png, model/"
)
