"""Regenerate the README benchmark tables from committed bench JSONs (never type a figure by hand).

Convention (CONTEXT: bench JSON): every ``packages/<pkg>/bench/bench_*.py`` writes a JSON carrying

- ``"machine"``: at least ``threads``; also ``cpu``/``processor``, ``load_average``, ``date`` (ISO) when known;
- ``"readme"``: ``{"title": str, "columns": [str, ...], "rows": [[str | number, ...], ...]}`` (optional
  ``"note"``: one line printed under the table).

Results a README shows are committed as ``packages/<pkg>/bench/results/<name>.json``; the package's README holds
the table between ``<!-- bench:<name>:begin -->`` and ``<!-- bench:<name>:end -->``. This script rewrites
those blocks from the JSONs. The root README's ``<!-- bench:summary:begin -->`` block is one headline per bench,
read from the same JSONs by the functions in ``bench_headlines.py``. ``--check`` rewrites nothing and exits 1
naming every stale README (or a marker whose JSON is missing); ``--summary DIR`` prints one table per JSON in
``DIR`` (``nox -s bench`` ends with it).

Exit codes: 0 ok, 1 stale README(s) under ``--check``, 2 bad input (malformed JSON or markers).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_headlines import HEADLINES

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(
    r"<!-- bench:(?P<name>[A-Za-z0-9_.-]+):begin -->\n(?P<body>.*?)<!-- bench:(?P=name):end -->", re.S
)


SUMMARY = re.compile(r"<!-- bench:summary:begin -->\n.*?<!-- bench:summary:end -->", re.S)


class BenchError(ValueError):
    """A malformed bench JSON or README marker (exit code 2)."""


def fmt_cell(value: object) -> str:
    """A table cell: floats with 3 significant digits (ratios) or thousands separators (large), else str."""
    if isinstance(value, bool) or value is None:
        return "" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def readme_block(data: dict[str, Any], source: str) -> dict[str, Any]:
    block = data.get("readme")
    if not isinstance(block, dict):
        raise BenchError(
            f"{source}: no \"readme\" block; add {{'title', 'columns', 'rows'}} to the bench JSON."
        )
    cols, rows = block.get("columns"), block.get("rows")
    if not isinstance(block.get("title"), str) or not isinstance(cols, list) or not isinstance(rows, list):
        raise BenchError(f'{source}: "readme" needs a str "title", a list "columns" and a list "rows".')
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(cols):
            raise BenchError(f"{source}: readme row {i} has {len(row) if isinstance(row, list) else '?'} "
                             f"cells; \"columns\" has {len(cols)}.")  # fmt: skip
    return block


def _load(m: dict[str, Any]) -> float | None:
    """The 1-minute load average a "machine" block recorded (a triple or one number), None if none."""
    load = m.get("load_average", m.get("load_average_at_end"))
    if isinstance(load, (list, tuple)) and load:
        load = load[0]
    return float(load) if isinstance(load, (int, float)) else None


def machine_line(data: dict[str, Any]) -> str:
    """Footer: machine, threads and date from the JSON's "machine" block."""
    m = data.get("machine")
    if not isinstance(m, dict):
        return "_machine: not recorded_"
    cpu = m.get("cpu") or m.get("processor") or m.get("cpu_model") or m.get("platform") or "unknown CPU"
    parts = [str(cpu)]
    if m.get("gpu"):
        parts.append(str(m["gpu"]))
    if m.get("cpu_count") is not None:
        parts.append(f"{m['cpu_count']} cores")
    if m.get("threads") is not None:
        parts.append(f"{m['threads']} torch threads")
    if (load := _load(m)) is not None:
        parts.append(f"load average {load:.1f}")
    parts.append(str(m.get("date", "undated")))
    return "_machine: " + ", ".join(parts) + "_"


def render(data: dict[str, Any], source: str) -> str:
    """The markdown between a bench's markers: title, table, optional note, machine footer."""
    block = readme_block(data, source)
    cols = [fmt_cell(c) for c in block["columns"]]
    lines = [f"**{block['title']}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt_cell(c) for c in row) + " |" for row in block["rows"]]
    lines.append("")
    if block.get("note"):
        lines += [str(block["note"]), ""]
    lines.append(machine_line(data))
    return "\n".join(lines) + "\n"


def load_results(root: Path = ROOT) -> dict[Path, dict[str, dict[str, Any]]]:
    """{package dir: {bench name: JSON}} from packages/*/bench/results/*.json."""
    out: dict[Path, dict[str, dict[str, Any]]] = {}
    for path in sorted(root.glob("packages/*/bench/results/*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise BenchError(f"{path}: not valid JSON ({e}).") from e
        out.setdefault(path.parents[2], {})[path.stem] = data
    return out


def regenerate(text: str, results: dict[str, dict[str, Any]], readme: Path) -> str:
    """``text`` with every bench block replaced by its JSON's rendering (unknown names raise)."""

    def sub(m: re.Match[str]) -> str:
        name = m.group("name")
        if name not in results:
            raise BenchError(
                f"{readme}: marker bench:{name} has no results JSON; commit {readme.parent}/bench/results/"
                f"{name}.json (copy it from bench-results/) or remove the marker."
            )
        body = render(results[name], f"{readme.parent.name}/bench/results/{name}.json")
        return f"<!-- bench:{name}:begin -->\n{body}<!-- bench:{name}:end -->"

    return MARKER.sub(sub, text)


def _measured(data: dict[str, Any]) -> str:
    """A summary row's "measured" cell: the JSON's date and load average."""
    m = data.get("machine")
    m = m if isinstance(m, dict) else {}
    when, load = str(m.get("date", "undated"))[:10], _load(m)
    return when if load is None else f"{when}, load {load:.1f}"


def render_summary(results: dict[Path, dict[str, dict[str, Any]]], root: Path) -> str:
    """The root README's summary table: one row per :data:`bench_headlines.HEADLINES` entry."""
    lines = ["| what | result | package | measured |", "|---|---|---|---|"]
    for h in HEADLINES:
        source = f"packages/composer-{h.package}/bench/results/{h.bench}.json"
        data = results.get(root / "packages" / f"composer-{h.package}", {}).get(h.bench)
        if data is None:
            raise BenchError(
                f"README.md: the headline {h.what!r} reads {source}, which is missing; commit it."
            )
        try:
            result = h.result(data)
        except (LookupError, TypeError, ValueError) as e:
            raise BenchError(
                f"{source}: the headline {h.what!r} cannot be read ({e}); update scripts/bench_headlines.py."
            ) from e
        lines.append(f"| {fmt_cell(h.what)} | {fmt_cell(result)} | {h.package} | {_measured(data)} |")
    return "\n".join(lines) + "\n"


def regenerate_summary(text: str, results: dict[Path, dict[str, dict[str, Any]]], root: Path) -> str:
    """``text`` (the root README) with its summary block rendered from the JSONs (unchanged without one)."""
    return SUMMARY.sub(
        lambda _: f"<!-- bench:summary:begin -->\n{render_summary(results, root)}<!-- bench:summary:end -->",
        text,
    )


def update(root: Path = ROOT, check: bool = False) -> list[Path]:
    """Rewrite (or with ``check`` only compare) every package README and the root README's summary; return
    the stale ones."""
    stale: list[Path] = []
    results = load_results(root)
    readmes = [*sorted(root.glob("packages/*/README.md")), root / "README.md"]
    for readme in (r for r in readmes if r.is_file()):
        text = readme.read_text()
        if readme.parent == root:
            new = regenerate_summary(text, results, root)
        else:
            new = regenerate(text, results.get(readme.parent, {}), readme)
        if new != text:
            stale.append(readme)
            if not check:
                readme.write_text(new)
    return stale


def summary(directory: Path) -> str:
    """One rendered table per JSON in ``directory`` (the end of ``nox -s bench``)."""
    parts: list[str] = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            parts.append(f"## {path.name}\n\n{render(data, path.name)}")
        except (json.JSONDecodeError, BenchError) as e:
            parts.append(f"## {path.name}\n\n(no table: {e})\n")
    return "\n".join(parts) if parts else f"(no bench JSON in {directory})\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--check", action="store_true", help="exit 1 naming READMEs whose tables are stale")
    p.add_argument("--summary", type=Path, metavar="DIR", help="print a table per JSON in DIR and exit")
    p.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.summary is not None:
        print(summary(args.summary), end="")
        return 0
    try:
        stale = update(args.root, check=args.check)
    except BenchError as e:
        print(f"bench_tables: {e}", file=sys.stderr)
        return 2
    for readme in stale:
        rel = readme.relative_to(args.root) if readme.is_relative_to(args.root) else readme
        verb = "is stale; run `python scripts/bench_tables.py`" if args.check else "updated"
        print(f"{rel}: benchmark table {verb}", file=sys.stderr if args.check else sys.stdout)
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
