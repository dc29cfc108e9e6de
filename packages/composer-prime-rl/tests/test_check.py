"""``python -m composer_prime_rl.check``: a PRIME-RL TOML's loss kwargs validated before training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from composer_prime_rl import EXAMPLES, example_config
from composer_prime_rl.check import main


@pytest.mark.parametrize("name", EXAMPLES)
def test_shipped_examples_pass(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(example_config(name))]) == 0
    assert "ok" in capsys.readouterr().out


def test_module_entry_point_exit_codes(tmp_path: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "composer_prime_rl.check", str(example_config("rl.toml"))],
                        capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(example_config("rl.toml").read_text().replace("kl_tau = 1e-3", 'kl_tau = "fast"'))
    out = subprocess.run(
        [sys.executable, "-m", "composer_prime_rl.check", str(bad)], capture_output=True, text=True
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and "`kl_tau`='fast' (str) is not a valid value" in lines[0]
        and "[trainer.loss.kwargs]" in lines[0]
    )


@pytest.mark.parametrize(
    ("overrides", "code", "needle"),
    [
        (
            ["--trainer.loss.kwargs.alpha_sdpo", "0.25", "--trainer.loss.kwargs.sdpo_token_clip", "false"],
            0,
            "ok",
        ),
        (["--trainer.loss.kwargs.alpha_sdpo=0.5"], 0, "alpha_sdpo=0.5"),
        (["--trainer.loss.kwargs.alpha_sdpo", "lots"], 2, "`alpha_sdpo`='lots' (str) is not a valid value"),
        (["--trainer.loss.kwargs.simpo_gamma", "0.2"], 2, "'simpo_gamma' was given"),
        (["--trainer.loss.kwargs.epsilon_low", "0.3"], 2, "only apply to the other policy loss"),
        (["--trainer.loss.kwargs.clip_eps", "0.2"], 2, "Unknown option 'clip_eps'"),
        (["--model.name", "x"], 2, "unexpected argument"),
    ],
)
def test_cli_style_overrides(
    overrides: list[str], code: int, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(example_config("rl.toml")), *overrides]) == code
    captured = capsys.readouterr()
    assert needle in (captured.out if code == 0 else captured.err)


def test_trainer_form_uses_loss_kwargs(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(example_config("trainer.toml"))
    assert main([path, "--loss.kwargs.sdpo_missing", "skip"]) == 0
    assert main([path, "--loss.kwargs.sdpo_missing", "never"]) == 2
    assert (
        "[loss.kwargs] `sdpo_missing`='never' (str) is not a valid value: expected one of"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[trainer.loss]\ntype = 'default'\n", 'set type = "custom"'),
        ("[model]\nname = 'x'\n", "no [trainer.loss]"),
        ("[trainer.loss\n", "not valid TOML"),
    ],
)
def test_configs_that_do_not_use_composer_are_bad(tmp_path: Path, text: str, needle: str, capsys) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    assert main([str(p)]) == 2
    assert needle in capsys.readouterr().err
    assert main([str(tmp_path / "missing.toml")]) == 2


def test_the_readme_check_block_runs_as_written_in_an_empty_directory(tmp_path):
    """Issue 52: the README's commands worked only where rl.toml already existed; run its block verbatim in an empty
    directory (the shipped examples are written by `--example`), every line exiting 0."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```bash check-config\n(.*?)```", readme, re.S)
    assert block is not None
    lines = [ln.split("  #")[0].strip() for ln in block.group(1).splitlines() if ln.strip()]
    assert len(lines) == 5
    for line in lines:
        cmd = line.replace("python ", f"{sys.executable} ", 1)
        run = subprocess.run(cmd, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (line, run.stderr)
    assert (tmp_path / "rl.toml").read_text().startswith(("#", "["))
