"""Without an optional extra, each feature raises ImportError naming the extra (runs in tests-core)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import composer_core.traces.schema  # noqa: F401  (core modules import with torch only)
import pytest
from composer_core.traces import hints, pairs, records, replay, replay_cli  # noqa: F401


def missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


@pytest.mark.skipif(not missing("httpx"), reason="httpx installed (replay extra present)")
def test_replay_without_httpx() -> None:
    t = replay.TeacherConfig("a", "http://127.0.0.1:1/v1", "m")
    with pytest.raises(ImportError, match=r"composer-core\[replay\]"):
        replay.Replayer([t])


def test_cli_without_replay_extra_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Issue 50: composer-replay --teachers without httpx printed a 27-line traceback (exit 1)."""
    traces = tmp_path / "t.jsonl"
    traces.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]})
        + "\n"
    )
    teachers = tmp_path / "teachers.toml"
    teachers.write_text('[[teachers]]\nname = "a"\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n')
    out = tmp_path / "out"
    out.mkdir()
    hide_httpx = (
        "import sys; sys.modules['httpx'] = None  # import httpx -> ImportError, as without the extra\n"
        "from composer_core.traces.replay_cli import main; sys.exit(main(sys.argv[1:]))"
    )
    argv = [
        "--traces",
        str(traces),
        "--teachers",
        str(teachers),
        "--out",
        str(out / "o.jsonl"),
        "--no-progress",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", hide_httpx, *argv], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        "composer-replay: error: --teachers needs the module httpx (replay extra): pip install 'composer-core[replay]'"
    ]
    assert not proc.stdout and list(out.iterdir()) == []


@pytest.mark.skipif(not missing("transformers"), reason="transformers installed (hf extra present)")
def test_cli_tokenizer_without_transformers(tmp_path: Path) -> None:
    traces = tmp_path / "t.jsonl"
    traces.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ImportError, match=r"composer-core\[hf\]"):
        replay_cli.main(["--traces", str(traces), "--out", str(tmp_path / "o.jsonl"), "--tokenizer", "x"])


@pytest.mark.skipif(not missing("data_juicer"), reason="py-data-juicer installed")
def test_datajuicer_without_library() -> None:
    from composer_core.traces.datajuicer import datajuicer_filter

    with pytest.raises(ImportError, match=r"composer-core\[datajuicer\]"):
        datajuicer_filter([], [])


@pytest.mark.skipif(not missing("pyarrow"), reason="pyarrow installed (parquet extra present)")
def test_parquet_without_pyarrow(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match=r"composer-core\[parquet\]"):
        records.write_records([], tmp_path / "r.parquet")
    with pytest.raises(ImportError, match=r"composer-core\[parquet\]"):
        records.read_records(tmp_path / "r.parquet")
