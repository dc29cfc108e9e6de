"""``composer-replay``: traces -> hinted SDPO sites + N-teacher preference pairs -> records.

    composer-replay --traces traces.jsonl --teachers teachers.toml --out pairs.jsonl

:func:`build_records` is the pipeline in memory; :func:`main` writes its records, ``<out>.failures.jsonl`` and
``<out>.summary.json`` (the options and exit statuses: ``--help`` and the package README).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from .hints import (
    HintSource,
    TeacherHint,
    TemplateHint,
    build_hinted_context,
    error_text_hint,
    load_hint_fn,
    tokenize_hinted,
)
from .pairs import Verifier, filter_pairs, make_pair
from .records import TraceRecord, write_records
from .replay import (
    DEFAULT_MAX_RESPONSE_BYTES,
    Replayer,
    ReplayJob,
    ReplayResult,
    TeacherConfig,
    TeacherStats,
    load_teachers,
)
from .schema import Episode, ErrorSite, find_error_sites, import_extra, read_traces

__all__ = ["EXIT_ALL_FAILED", "EXIT_TOO_MANY_FAILED", "BuildResult", "build_records", "main", "plot_summary"]

EXIT_ALL_FAILED = 3
EXIT_TOO_MANY_FAILED = 4
DEFAULT_MAX_FAILURE_RATE = 0.5


@dataclass
class BuildResult:
    records: list[TraceRecord]
    failures: list[dict[str, Any]]
    dropped: dict[str, int] = field(default_factory=dict)
    states: int = 0
    sdpo_sites: int = 0
    pairs: int = 0
    requests: int = 0  # teacher requests (one per state and teacher; cached ones included)


def build_records(
    episodes: Sequence[Episode],
    replayer: Replayer | None,
    *,
    states: Literal["all", "errors"] = "all",
    hint_source: HintSource | None = None,
    tokenizer: Any = None,
    tokenizer_name: str | None = None,
    chat_template: bool | None = None,
    verifier: Verifier | None = None,
    min_chars: int = 1,
    max_chars: int | None = None,
    dedupe: bool = True,
    progress: bool = True,
) -> BuildResult:
    """Run the pipeline in memory (the CLI is a thin wrapper around this)."""
    if states not in ("all", "errors"):
        raise ValueError(f"states must be 'all' or 'errors', got {states!r}")
    if tokenizer is not None and hint_source is None:
        raise ValueError("a tokenizer only serves SDPO masks: also pass hint_source")
    sites, targets = _targets(episodes, states)

    results, failures = _replay_all(replayer, targets, progress)
    made = [make_pair(ep, t, results.get((ep.id, t), []), verifier=verifier) for ep, t in targets]
    kept, dropped = filter_pairs(
        [p for p in made if p is not None], min_chars=min_chars, max_chars=max_chars, dedupe=dedupe
    )
    pairs = {(p.episode_id, p.turn): p for p in kept}
    out = BuildResult([], failures, dropped, len(targets), requests=sum(map(len, results.values())))
    for ep, t in targets:
        row: dict[str, Any] = {
            "id": f"{ep.id}@{t}",
            "episode_id": ep.id,
            "turn": t,
            "prompt": [m.to_dict() for m in ep.messages[:t]],
            "completion": [ep.messages[t].to_dict()],
            "tools": [dict(x) for x in ep.tools],
        }
        site_list = sites.get((ep.id, t), [])
        if site_list:
            row["error_kinds"] = sorted({k for s in site_list for k in s.kinds})
        if site_list and hint_source is not None:
            row |= _sdpo_fields(ep, site_list[0], hint_source, tokenizer, tokenizer_name, chat_template)
            out.sdpo_sites += 1
        p = pairs.get((ep.id, t))
        if p is not None:
            row |= {
                "chosen": [p.chosen.to_dict()],
                "rejected": [p.rejected.to_dict()],
                "chosen_by": p.chosen_by,
                "chosen_teachers": list(p.teachers),
            }
            out.pairs += 1
        if "teacher_prompt" in row or "chosen" in row:
            out.records.append(TraceRecord(**row))
    return out


def _targets(
    episodes: Sequence[Episode], states: str
) -> tuple[dict[tuple[str, int], list[ErrorSite]], list[tuple[Episode, int]]]:
    """The error sites by (episode, turn), and the states to replay: every assistant turn, or those with an
    error site."""
    sites: dict[tuple[str, int], list[ErrorSite]] = {}
    targets: list[tuple[Episode, int]] = []
    for ep in episodes:
        for s in find_error_sites(ep):
            sites.setdefault((ep.id, s.action_turn), []).append(s)
        turns = ep.assistant_turns() if states == "all" else sorted({t for (e, t) in sites if e == ep.id})
        targets += [(ep, t) for t in turns if t > 0]  # an action with no context before it is no state
    ids = [f"{ep.id}@{t}" for ep, t in targets]
    if len(set(ids)) != len(ids):
        raise ValueError("episode ids must be unique across the input traces")
    return sites, targets


def _replay_all(
    replayer: Replayer | None, targets: list[tuple[Episode, int]], progress: bool
) -> tuple[dict[tuple[str, int], list[ReplayResult]], list[dict[str, Any]]]:
    """Every teacher's action at every target state (with a progress bar), and the failed requests."""
    results: dict[tuple[str, int], list[ReplayResult]] = {}
    failures: list[dict[str, Any]] = []
    if replayer is None or not targets:
        return results, failures
    jobs = [
        ReplayJob(name, ep.messages[:t], ep.tools) for ep, t in targets for name in replayer.teacher_names
    ]
    tqdm = importlib.import_module("tqdm.auto").tqdm
    with tqdm(
        total=len(jobs), desc="teacher replay", unit="req", disable=not progress, file=sys.stderr
    ) as bar:

        def tick(r: ReplayResult) -> None:
            bar.update(1)
            hits = sum(s.cache_hits for s in replayer.stats.values())
            fails = sum(s.failures for s in replayer.stats.values())
            bar.set_postfix(cache_hits=hits, failures=fails, refresh=False)

        flat = asyncio.run(replayer.areplay(jobs, tick))
    n = len(replayer.teacher_names)
    for i, (ep, t) in enumerate(targets):
        rs = flat[i * n : (i + 1) * n]
        results[(ep.id, t)] = rs
        failures += [
            {"episode_id": ep.id, "turn": t, "teacher": r.teacher, "model": r.model, "reason": r.failure}
            for r in rs
            if not r.ok
        ]
    return results, failures


def _sdpo_fields(
    ep: Episode,
    site: ErrorSite,
    hint_source: HintSource,
    tokenizer: Any,
    tokenizer_name: str | None,
    chat_template: bool | None,
) -> dict[str, Any]:
    """A record's channel-2 fields at an error site: the hinted teacher prompt, and its token ids and SDPO mask
    when a tokenizer is given."""
    ctx = build_hinted_context(ep, site, hint_source)
    row: dict[str, Any] = {
        "teacher_prompt": [m.to_dict() for m in ctx.teacher_prompt],
        "hint": ctx.hint,
        "hint_index": ctx.hint_index,
    }
    if tokenizer is not None:
        tok = tokenize_hinted(ctx, tokenizer, chat_template=chat_template)
        row |= {
            "tokenizer": tokenizer_name or type(tokenizer).__name__,
            "prompt_ids": tok.prompt_ids,
            "teacher_prompt_ids": tok.teacher_prompt_ids,
            "completion_ids": tok.completion_ids,
            "sdpo_mask": tok.sdpo_mask,
        }
    return row


def _load_verifier(spec: str) -> Verifier:
    try:
        return load_hint_fn(spec, option="--verifier")
    except ValueError as e:
        raise SystemExit(str(e)) from e


def _load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    auto = import_extra("transformers", "--tokenizer", "hf").AutoTokenizer
    return auto.from_pretrained(path, trust_remote_code=trust_remote_code)


def plot_summary(summary: dict[str, Any], path: str | Path) -> None:
    """Bar charts per teacher (requests / cache hits / failures, tokens, cost) as a PNG (``plot`` extra)."""
    import_extra("matplotlib", "--plot", "plot").use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    teachers = summary["teachers"]
    if not teachers:
        raise ValueError("the summary has no teachers to plot (run with --teachers)")
    names = list(teachers)
    x = list(range(len(names)))
    fig, axes = plt.subplots(1, 3, figsize=(4 + 3 * len(names), 3.5))
    panels = [
        ("requests", ["requests", "cache_hits", "retries", "failures"]),
        ("tokens", ["prompt_tokens", "completion_tokens"]),
        ("cost (USD)", ["cost_usd"]),
    ]
    for ax, (title, cols) in zip(axes, panels):
        width = 0.8 / len(cols)
        for j, col in enumerate(cols):
            ax.bar([i + j * width for i in x], [teachers[n][col] for n in names], width, label=col)
        ax.set_xticks([i + 0.4 - width / 2 for i in x], names)
        ax.set_title(title)
        if len(cols) > 1:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="composer-replay",
        description="Replay N teacher models at the states of agent traces; write SDPO sites and preference pairs.",
        epilog=(
            "exit status: 0 done; 1 unexpected error; 2 bad arguments or input, the replay extra missing, a bad "
            "--teachers file or a teacher's api_key_env unset or blank (one line, before any request or output); 3 every teacher request "
            "failed; 4 more than --max-failure-rate of them failed (0, 3, 4: outputs are written)"
        ),
    )
    ap.add_argument(
        "--traces", required=True, nargs="+", help="episode JSONL files (OpenAI chat or Claude Code)"
    )
    ap.add_argument("--format", default="auto", choices=["auto", "openai", "claude-code"])
    ap.add_argument("--teachers", help="teachers.toml ([[teachers]] tables); omit to only build SDPO sites")
    ap.add_argument(
        "--out", required=True, help="output records (.jsonl, or .parquet with the parquet extra)"
    )
    ap.add_argument("--cache-dir", help="replay cache directory (default: <out>.cache)")
    ap.add_argument("--failures", help="failed requests JSONL (default: <out>.failures.jsonl)")
    ap.add_argument("--summary", help="summary JSON (default: <out>.summary.json)")
    ap.add_argument(
        "--states",
        default="all",
        choices=["all", "errors"],
        help="replay every student turn or only faulty ones",
    )
    ap.add_argument(
        "--hint", default="error-text", help="'error-text', 'template', 'teacher:<name>' or 'none'"
    )
    ap.add_argument("--hint-template", help="str.format template for --hint template")
    ap.add_argument(
        "--tokenizer", help="Hugging Face tokenizer (local dir) for token ids and SDPO masks (hf extra)"
    )
    ap.add_argument("--chat-template", default="auto", choices=["auto", "on", "off"])
    ap.add_argument(
        "--trust-remote-code", action="store_true", help="allow tokenizer code from the tokenizer dir"
    )
    ap.add_argument("--verifier", help="'module:function' accepting (episode, turn, message) -> bool")
    ap.add_argument("--min-chars", type=int, default=1)
    ap.add_argument("--max-chars", type=int)
    ap.add_argument("--no-dedupe", action="store_true")
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument(
        "--max-response-bytes",
        type=int,
        default=DEFAULT_MAX_RESPONSE_BYTES,
        help="refuse (record as failed) teacher responses larger than this (default: %(default)s = 8 MiB)",
    )
    ap.add_argument(
        "--max-failure-rate",
        type=float,
        default=DEFAULT_MAX_FAILURE_RATE,
        help="exit 4 when more than this fraction of teacher requests failed (default: %(default)s); "
        "exit 3 when all failed",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--plot", help="also draw the per-teacher summary as a PNG (plot extra)")
    return ap


def _hint_source(spec: str, template: str | None, replayer: Replayer | None) -> HintSource | None:
    if spec == "none":
        return None
    if spec == "error-text":
        return error_text_hint()
    if spec == "template":
        if not template:
            raise SystemExit("--hint template needs --hint-template")
        return TemplateHint(template)
    if spec.startswith("teacher:"):
        if replayer is None:
            raise SystemExit("--hint teacher:<name> needs --teachers")
        return TeacherHint(replayer, spec.removeprefix("teacher:"))
    raise SystemExit(f"--hint must be error-text, template, teacher:<name> or none, got {spec!r}")


def _print_summary(summary: dict[str, Any]) -> None:
    cols = [f.name for f in fields(TeacherStats)]
    teachers = summary["teachers"]
    width = max([len("teacher"), *(len(n) for n in teachers)])
    print(f"{'teacher':<{width}}  " + "  ".join(f"{c:>17}" for c in cols))
    for name, st in teachers.items():
        cells = [f"{st[c]:>17.6f}" if c == "cost_usd" else f"{st[c]:>17d}" for c in cols]
        print(f"{name:<{width}}  " + "  ".join(cells))
    print(
        f"states {summary['states']}, records {summary['records']} (sdpo sites {summary['sdpo_sites']}, "
        f"pairs {summary['pairs']}), failed requests {summary['failed_requests']}, dropped pairs {summary['dropped']}"
    )


def _exit_status(result: BuildResult, max_failure_rate: float, failures_path: Path) -> int:
    failed, total = len(result.failures), result.requests
    if not total or not failed:
        return 0
    if failed == total:
        print(
            f"composer-replay: error: all {total} teacher requests failed (reasons in {failures_path}); "
            "check api_key_env, base_url and the endpoints",
            file=sys.stderr,
        )
        return EXIT_ALL_FAILED
    if failed / total > max_failure_rate:
        print(
            f"composer-replay: error: {failed} of {total} teacher requests failed ({failed / total:.0%} > "
            f"--max-failure-rate {max_failure_rate:g}; reasons in {failures_path})",
            file=sys.stderr,
        )
        return EXIT_TOO_MANY_FAILED
    return 0


def _usable_teachers(path: str) -> list[TeacherConfig] | str:
    """The teachers of ``path``, or one line saying why none can be asked (checked before any request)."""
    try:
        import_extra("httpx", "--teachers", "replay")
        teachers = load_teachers(path)
        for t in teachers:
            t.api_key()
    except (ImportError, ValueError) as e:
        return str(e)
    return teachers


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.max_failure_rate <= 1.0:
        parser.error(f"--max-failure-rate must be in [0, 1], got {args.max_failure_rate}")
    if args.max_response_bytes < 1:
        parser.error(f"--max-response-bytes must be >= 1, got {args.max_response_bytes}")
    out = Path(args.out)
    teachers = _usable_teachers(args.teachers) if args.teachers else []
    if isinstance(teachers, str):
        print(f"composer-replay: error: {teachers}", file=sys.stderr)
        return 2
    episodes = [ep for path in args.traces for ep in read_traces(path, args.format)]
    replayer = None
    if teachers:
        cache = Path(args.cache_dir) if args.cache_dir else out.with_name(out.name + ".cache")
        replayer = Replayer(
            teachers, cache, max_concurrency=args.max_concurrency, max_response_bytes=args.max_response_bytes
        )
    hint = _hint_source(args.hint, args.hint_template, replayer)
    tokenizer = _load_tokenizer(args.tokenizer, args.trust_remote_code) if args.tokenizer else None
    result = build_records(
        episodes,
        replayer,
        states=args.states,
        hint_source=hint,
        tokenizer=tokenizer,
        tokenizer_name=args.tokenizer,
        chat_template={"auto": None, "on": True, "off": False}[args.chat_template],
        verifier=_load_verifier(args.verifier) if args.verifier else None,
        min_chars=args.min_chars,
        max_chars=args.max_chars,
        dedupe=not args.no_dedupe,
        progress=not args.no_progress,
    )
    write_records(result.records, out)
    failures_path = Path(args.failures) if args.failures else out.with_name(out.name + ".failures.jsonl")
    failures_path.write_text("".join(json.dumps(row) + "\n" for row in result.failures), encoding="utf-8")
    summary = {
        "episodes": len(episodes),
        "states": result.states,
        "records": len(result.records),
        "sdpo_sites": result.sdpo_sites,
        "pairs": result.pairs,
        "teacher_requests": result.requests,
        "failed_requests": len(result.failures),
        "dropped": result.dropped,
        "teachers": replayer.summary() if replayer else {},
    }
    summary_path = Path(args.summary) if args.summary else out.with_name(out.name + ".summary.json")
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    _print_summary(summary)
    if args.plot:
        plot_summary(summary, args.plot)
    return _exit_status(result, args.max_failure_rate, failures_path)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
