"""scripts/bench_tables.py: README benchmark tables regenerated from committed bench JSONs."""

from __future__ import annotations

import json
from pathlib import Path

import bench_headlines
import bench_tables
import pytest

RESULT = {
    "machine": {"processor": "Test CPU", "cpu_count": 2, "threads": 1, "load_average": [3.25, 1, 1],
                "date": "2026-11-23T10:00:00Z"},
    "readme": {"title": "JSD fwd+bwd", "columns": ["V", "ratio", "method"],
               "rows": [[32768, 1.23456, "fused"], [152064, 0.5, "a|b"]]},
}  # fmt: skip


def _workspace(tmp_path: Path, readme: str, results: dict[str, object] | None = None) -> Path:
    pkg = tmp_path / "packages" / "composer-x"
    (pkg / "bench" / "results").mkdir(parents=True)
    (pkg / "README.md").write_text(readme)
    for name, data in (results or {}).items():
        (pkg / "bench" / "results" / f"{name}.json").write_text(json.dumps(data))
    return pkg / "README.md"


BLOCK = "intro\n<!-- bench:bench_x:begin -->\nold figure 9.9 s\n<!-- bench:bench_x:end -->\nafter\n"


def test_render_has_title_table_and_machine_footer() -> None:
    text = bench_tables.render(RESULT, "x.json")
    assert text.splitlines()[:5] == [
        "**JSD fwd+bwd**",
        "",
        "| V | ratio | method |",
        "|---|---|---|",
        "| 32,768 | 1.23 | fused |",
    ]
    assert "| 152,064 | 0.5 | a\\|b |" in text  # pipes in cells escaped
    assert text.rstrip().endswith(
        "_machine: Test CPU, 2 cores, 1 torch threads, load average 3.2, 2026-11-23T10:00:00Z_"
    )


def test_update_rewrites_between_markers_and_check_then_passes(tmp_path: Path) -> None:
    readme = _workspace(tmp_path, BLOCK, {"bench_x": RESULT})
    assert bench_tables.main(["--root", str(tmp_path), "--check"]) == 1  # hand-typed figure is stale
    assert "old figure" in readme.read_text()  # --check writes nothing
    assert bench_tables.main(["--root", str(tmp_path)]) == 0
    text = readme.read_text()
    assert "old figure" not in text and "| 32,768 | 1.23 | fused |" in text
    assert text.startswith("intro\n<!-- bench:bench_x:begin -->\n") and text.endswith(
        "<!-- bench:bench_x:end -->\nafter\n"
    )
    assert bench_tables.main(["--root", str(tmp_path), "--check"]) == 0
    assert bench_tables.update(tmp_path) == []  # idempotent


def test_check_names_the_stale_readme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _workspace(tmp_path, BLOCK, {"bench_x": RESULT})
    assert bench_tables.main(["--root", str(tmp_path), "--check"]) == 1
    assert "packages/composer-x/README.md: benchmark table is stale" in capsys.readouterr().err


def test_marker_without_json_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _workspace(tmp_path, BLOCK)
    assert bench_tables.main(["--root", str(tmp_path), "--check"]) == 2
    assert "bench:bench_x has no results JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("readme", "message"),
    [
        ({"title": "t", "columns": ["a"], "rows": [[1, 2]]}, "row 0 has 2 cells"),
        (None, 'no "readme" block'),
        ({"title": "t", "columns": "a", "rows": []}, "needs a str"),
    ],
)
def test_malformed_readme_block_is_named(tmp_path: Path, readme: object, message: str) -> None:
    data = {"machine": {}, **({"readme": readme} if readme is not None else {})}
    _workspace(tmp_path, BLOCK, {"bench_x": data})
    with pytest.raises(bench_tables.BenchError, match=message):
        bench_tables.update(tmp_path, check=True)


def test_summary_prints_every_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.json").write_text(json.dumps(RESULT))
    (tmp_path / "b.json").write_text(json.dumps({"machine": {}}))
    assert bench_tables.main(["--summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "## a.json" in out and "| 32,768 | 1.23 | fused |" in out
    assert "## b.json" in out and 'no "readme" block' in out


def test_repository_readmes_are_current() -> None:
    assert bench_tables.update(bench_tables.ROOT, check=True) == []


ROOT_README = "# x\n<!-- bench:summary:begin -->\n| fused | 9.99× |\n<!-- bench:summary:end -->\nend\n"


@pytest.fixture
def one_headline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The summary reads one headline: composer-x's bench_x, its fused row's ratio."""
    headline = bench_headlines.Headline(
        "x", "bench_x", "JSD", lambda d: f"{bench_headlines.cell(d, 'ratio', method='fused'):.2f}×"
    )
    monkeypatch.setattr(bench_tables, "HEADLINES", (headline,))


def test_root_summary_is_read_from_the_json_and_a_typed_figure_is_stale(
    tmp_path: Path, one_headline: None
) -> None:
    _workspace(tmp_path, "no markers\n", {"bench_x": RESULT})
    (tmp_path / "README.md").write_text(ROOT_README)
    assert bench_tables.main(["--root", str(tmp_path), "--check"]) == 1  # 9.99× was typed, the JSON says 1.23
    assert bench_tables.main(["--root", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    assert "| JSD | 1.23× | x | 2026-11-23, load 3.2 |" in text and "9.99" not in text
    assert text.startswith("# x\n<!-- bench:summary:begin -->\n| what |") and text.endswith("end\n")
    assert bench_tables.main(["--root", str(tmp_path), "--check"]) == 0


def test_a_headline_the_json_no_longer_has_is_bad_input(
    tmp_path: Path, one_headline: None, capsys: pytest.CaptureFixture[str]
) -> None:
    renamed = {**RESULT, "readme": {**RESULT["readme"], "columns": ["V", "speedup", "method"]}}  # type: ignore[dict-item]
    _workspace(tmp_path, "no markers\n", {"bench_x": renamed})
    (tmp_path / "README.md").write_text(ROOT_README)
    assert bench_tables.main(["--root", str(tmp_path), "--check"]) == 2
    err = capsys.readouterr().err
    assert "packages/composer-x/bench/results/bench_x.json: the headline 'JSD' cannot be read" in err
    assert "no column 'ratio'" in err and "update scripts/bench_headlines.py" in err


def test_every_repository_headline_reads_its_committed_json() -> None:
    results = bench_tables.load_results(bench_tables.ROOT)
    for h in bench_headlines.HEADLINES:
        data = results[bench_tables.ROOT / "packages" / f"composer-{h.package}"][h.bench]
        assert h.result(data).strip(), h.what
