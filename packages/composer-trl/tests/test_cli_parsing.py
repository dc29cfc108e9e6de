"""`composer-train`'s command line follows TRL's conventions (HfArgumentParser over the config + script args)."""

from __future__ import annotations

import json
import os

import pytest
from composer_trl.cli import main, parse
from composer_trl.job import Job
from composer_trl.lifecycle import EXIT_USAGE, UsageError


def _config(argv, tmp_path):
    inv = parse([*argv, "--output_dir", str(tmp_path / "o")])
    job = Job(inv.recipe, tmp_path / "o")
    job.check()  # the config is built once, after the data chose the channels the command line left unset
    return inv, job.config


def test_every_config_field_is_a_flag_and_strings_are_typed(tmp_path):
    inv, c = _config(
        [
            "--alpha_sdpo",
            "0.5",
            "--learning_rate",
            "1e-6",
            "--sdpo_wrapper",
            "taid",
            "--beta",
            "0.02",
            "--use_bias_correction_kl",
            "false",
            "--save_steps",
            "5",
            "--max_steps",
            "7",
            "--seed",
            "3",
        ],
        tmp_path,
    )
    assert c.alpha_sdpo == 0.5 and c.learning_rate == 1e-6 and c.sdpo_wrapper == "taid" and c.beta == 0.02
    assert c.use_bias_correction_kl is False
    assert c.use_bias_correction_kl is False
    assert c.save_steps == 5 and c.save_strategy == "steps" and c.max_steps == 7 and c.seed == 3
    assert c.per_device_train_batch_size == 32  # tiny-model default kept where no flag was given
    assert inv.recipe.steps == 7 and inv.recipe.seed == 3


def test_sdpo_chunk_size_flag_is_rows_and_defaults_to_the_vocabulary_budget(tmp_path):
    """Rows per chunk of the fused kernel: an int from the command line, None (core's default: ``chunk_rows``, by form
    and V) without the flag; a bad value is one line naming the option."""
    _, c = _config(["--sdpo_chunk_size", "512"], tmp_path)
    assert c.sdpo_chunk_size == 512 and type(c.sdpo_chunk_size) is int
    _, c = _config([], tmp_path)
    assert c.sdpo_chunk_size is None
    with pytest.raises(UsageError, match="`sdpo_chunk_size`=0 must be an int >= 1"):
        _config(["--sdpo_chunk_size", "0"], tmp_path)


def test_sdpo_compiled_flag_is_a_bool_refused_where_it_has_no_effect(tmp_path):
    """``--sdpo_compiled true`` (core's compiled JSD chunk kernel) reaches the typed core config; off without the
    flag; with the sampled form, which has no chunk kernel, it is one line naming the option."""
    _, c = _config(["--sdpo_compiled", "true"], tmp_path)
    assert c.sdpo_compiled is True and c.compose_config.sdpo.compiled is True
    _, c = _config([], tmp_path)
    assert c.sdpo_compiled is False and c.compose_config.sdpo.compiled is False
    with pytest.raises(UsageError, match=r"`sdpo_compiled`=True .*acts only with sdpo_form='full'"):
        _config(["--sdpo_compiled", "true", "--sdpo_form", "sampled"], tmp_path)


def test_legacy_flags_still_work(tmp_path):
    inv = parse(
        ["--model", "org/name", "--steps", "9", "--output-dir", str(tmp_path), "--no-plot", "--threads", "2"]
    )
    assert inv.recipe.model == "org/name" and inv.recipe.steps == 9 and not inv.plot and inv.threads == 2
    assert inv.recipe.output_dir == str(tmp_path)


def test_several_reward_funcs_and_resume(tmp_path):
    inv = parse(
        ["--reward_funcs", "a.b:f", "c.d:g", "--resume_from_checkpoint", "last", "--dataset_name", "x.csv"]
    )
    assert inv.recipe.reward == ["a.b:f", "c.d:g"] and inv.resume == "last" and inv.recipe.dataset == "x.csv"


def test_flat_trl_yaml_config_and_cli_override(tmp_path, monkeypatch):
    monkeypatch.delenv("COMPOSER_TEST_FOO", raising=False)
    y = tmp_path / "grpo.yaml"
    y.write_text(
        "model_name_or_path: org/m\nlearning_rate: 1e-6\nalpha_sdpo: 0.25\nmax_steps: 11\nenv:\n  COMPOSER_TEST_FOO: bar\n"
    )
    inv, c = _config(["--config", str(y), "--alpha_sdpo", "0.75"], tmp_path)
    assert inv.recipe.model == "org/m" and inv.recipe.steps == 11
    assert os.environ["COMPOSER_TEST_FOO"] == "bar"  # TrlParser's env: block
    assert (
        c.learning_rate == 1e-6
    )  # YAML reads 1e-6 as a string; typed like the flag and c.alpha_sdpo == 0.75  # the command line wins over the file
    assert c.per_device_train_batch_size == 8  # real-model defaults (model_name_or_path given)


def test_composer_recipe_toml_still_works(tmp_path):
    t = tmp_path / "r.toml"
    t.write_text("steps = 5\nseed = 2\n[trainer]\nalpha_sdpo = 0.5\n")
    inv, c = _config(["--config", str(t)], tmp_path)
    assert inv.recipe.steps == 5 and inv.recipe.seed == 2 and c.alpha_sdpo == 0.5


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--alpah_sdpo", "0.5"], "unknown argument --alpah_sdpo; did you mean --alpha_sdpo"),
        (["--learning-rat", "1"], "did you mean --learning_rate"),
        (["--alpha_sdpo", "abc"], "--alpha_sdpo"),
        (["--sdpo_wrapper", "tiad"], "tiad"),
        (["--max_steps", "0"], "--max_steps"),
    ],
)
def test_config_mistakes_are_one_line_exit_2(tmp_path, capsys, argv, match):
    assert main([*argv, "--output_dir", str(tmp_path / "o"), "--no_plot"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("composer-train: error:") and match in err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_unknown_key_in_config_file_names_closest(tmp_path, capsys):
    y = tmp_path / "c.yaml"
    y.write_text("learnig_rate: 1.0e-6\n")
    assert main(["--config", str(y), "--output_dir", str(tmp_path / "o")]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "unknown field 'learnig_rate'" in err and "--learning_rate" in err and len(err.splitlines()) == 1


def test_local_dataset_formats_are_loaded(tmp_path):
    from composer_core.tasks.digit_reversal import make_dataset_rows
    from composer_trl.data import load_dataset_checked
    from composer_trl.recipe import Recipe

    rows = make_dataset_rows(6, seed=0)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "d.csv").write_text(
        "prompt,chosen,rejected\n" + "".join(f"{r['prompt']},{r['chosen']},{r['rejected']}\n" for r in rows)
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for ext in ("jsonl", "json", "csv", "parquet"):
        ds = load_dataset_checked(Recipe(dataset=str(tmp_path / f"d.{ext}")), need=2, n_rows=0)
        assert len(ds) == 6 and ds[0]["prompt"] == rows[0]["prompt"], ext


def test_grpo_trainer_options_arrive_as_strings_and_are_taken(tmp_path):
    """Issue 50: every GRPOConfig option group GRPOTrainer accepts is accepted from the command line."""
    _, c = _config(
        ["--loss_type", "vespo", "--importance_sampling_level", "sequence", "--top_entropy_quantile", "0.5",
         "--off_policy_mask_threshold", "0.1", "--entropy_coef", "0.01", "--use_adaptive_entropy", "true",
         "--use_vllm", "true", "--vllm_mode", "server", "--use_liger_kernel", "true", "--vespo_k_pos", "1.5"],
        tmp_path,
    )  # fmt: skip
    assert c.loss_type == "vespo" and c.importance_sampling_level == "sequence" and c.use_vllm is True
    assert c.compose_config.policy.vespo_k_pos == 1.5
    assert c.top_entropy_quantile == 0.5 and c.off_policy_mask_threshold == 0.1 and c.use_liger_kernel is True


def test_an_option_of_another_loss_type_is_one_line_exit_2(tmp_path, capsys):
    argv = ["--loss_type", "grpo", "--sapo_temperature_pos", "2.0", "--output_dir", str(tmp_path / "o")]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sapo_temperature_pos" in err and not (tmp_path / "o").exists()


def test_unset_channel_weights_are_chosen_from_the_data_in_one_line(tmp_path):
    from composer_trl.recipe import choose_channels

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}>"}) + "\n" for i in range(64)))
    inv = parse(["--dataset_name", str(data), "--output_dir", str(tmp_path / "o")])
    job = Job(inv.recipe, tmp_path / "o")
    job.check()
    c = job.config
    assert (c.alpha_sdpo, c.sdpo_teacher_context, c.beta_replay) == (1.0, "success", 0.0)
    assert job.channel_line == (  # printed once the model has loaded
        "composer-train: alpha_sdpo=1.0 (no hints: a successful sibling of each group teaches), beta_replay=0.0 "
        "(no chosen/rejected columns); set --alpha_sdpo / --beta_replay to choose."
    )
    chosen, line = choose_channels({}, {"prompt", "hint", "chosen", "rejected"}, hints=False)
    assert chosen == {"alpha_sdpo": 1.0, "beta_replay": 1.0} and "hints teach" in line
    assert choose_channels({"alpha_sdpo": 0, "beta_replay": 0}, set(), hints=False) == ({}, "")


def test_reward_funcs_are_found_as_trl_grpo_finds_them(tmp_path, monkeypatch):
    """Issue 52: a reward.py in the working directory by `module.function` (TRL's form) or `module:function`, and
    TRL's built-in reward names; a bad form says which forms work."""
    import sys

    from composer_trl.recipe import import_callable
    from trl.rewards import think_format_reward

    (tmp_path / "cwd_reward_52.py").write_text(
        "def f(completions, **kw):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert import_callable("cwd_reward_52.f", "reward_funcs")(completions=["a"]) == [1.0]
    assert import_callable("cwd_reward_52:f", "reward_funcs")(completions=["a"]) == [1.0]
    assert import_callable("think_format_reward", "reward_funcs") is think_format_reward
    with pytest.raises(ValueError, match=r"'module.function' or 'module:function' or one of TRL's"):
        import_callable("f", "reward_funcs")
    with pytest.raises(ValueError, match=r"cannot be imported .*No module named 'nope_52'"):
        import_callable("nope_52.f", "reward_funcs")


def test_config_file_values_are_typed_by_trl_parser_and_a_flag_at_its_default_still_wins(tmp_path):
    """``--config`` goes through TRL's ``TrlParser.set_defaults_with_config``: the file's strings are converted as the
    flag's would be (a bad one is one line naming the flag), a flag wins even when it repeats the parser's default,
    and what neither sets stays the recipe's default."""
    y = tmp_path / "c.yaml"
    y.write_text("alpha_sdpo: '0.5'\nuse_bias_correction_kl: 'false'\nseed: '4'\n")
    inv = parse(["--config", str(y), "--alpha_sdpo", "0"])
    assert inv.recipe.trainer == {"alpha_sdpo": 0.0, "use_bias_correction_kl": False} and inv.recipe.seed == 4
    assert "learning_rate" not in inv.recipe.trainer  # neither set it: the tiny-model default applies
    y.write_text("learning_rate: fast\n")
    with pytest.raises(
        UsageError, match=r"--config .*c.yaml: argument --learning_rate.*: invalid float value: 'fast'"
    ):
        parse(["--config", str(y)])
    y.write_text("config: other.yaml\n")
    with pytest.raises(UsageError, match="unknown field 'config'"):
        parse(["--config", str(y)])
