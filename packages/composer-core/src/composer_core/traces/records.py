"""The one output schema the adapters consume (channels 2 and 3): :class:`TraceRecord`, one per student state,
messages in TRL's conversational layout; JSONL and Parquet, every row validated (package README: "Output schema").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .schema import Message, _json_lines, import_extra, message_from_dict

__all__ = [
    "MESSAGE_COLUMNS",
    "TraceRecord",
    "read_records",
    "records_from_rows",
    "validate_record",
    "write_records",
]

MESSAGE_COLUMNS = ("prompt", "completion", "tools", "teacher_prompt", "chosen", "rejected")


@dataclass(frozen=True)
class TraceRecord:
    """One row of the output schema; messages are OpenAI chat dicts, ``null`` where a channel is absent."""

    id: str  # "{episode_id}@{turn}", unique
    episode_id: str
    turn: int
    prompt: list[dict[str, Any]]  # the student's context x
    completion: list[dict[str, Any]]  # [the student's action y at x]
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool schemas of the episode
    teacher_prompt: list[dict[str, Any]] | None = None  # channel 2: x with the hint message inserted
    hint: str | None = None  # channel 2: the hint text
    hint_index: int | None = None  # position of the hint message in teacher_prompt
    error_kinds: list[str] = field(default_factory=list)  # error signals at this site
    tokenizer: str | None = None  # the tokenizer the ids and mask belong to
    prompt_ids: list[int] | None = None  # tokens of prompt (with the generation prompt)
    teacher_prompt_ids: list[int] | None = None
    completion_ids: list[int] | None = None  # tokens of completion (shared by both contexts)
    sdpo_mask: list[int] | None = None  # 0/1 per completion token: where to distil
    chosen: list[dict[str, Any]] | None = None  # channel 3: [the preferred (teacher) action]
    rejected: list[dict[str, Any]] | None = None  # channel 3: [the student's action] (= completion)
    chosen_by: str | None = None  # "verifier" or "majority"
    chosen_teachers: list[str] = field(default_factory=list)  # teachers that gave the chosen action
    ref_chosen_logp: float | None = None  # optional summed reference log-probs of chosen / rejected
    ref_rejected_logp: float | None = None

    @property
    def has_sdpo(self) -> bool:
        return self.teacher_prompt is not None

    @property
    def has_pair(self) -> bool:
        return self.chosen is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS = {f.name for f in fields(TraceRecord)}


def _messages(value: Any, column: str, where: str) -> list[Message]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: {column} must be a list of OpenAI chat messages")
    return [message_from_dict(m, f"{where}: {column}[{i}]") for i, m in enumerate(value)]


def _one_assistant(value: Any, column: str, where: str) -> Message:
    msgs = _messages(value, column, where)
    if len(msgs) != 1 or msgs[0].role != "assistant":
        raise ValueError(f"{where}: {column} must be a list holding exactly one assistant message")
    return msgs[0]


def _int_list(value: Any, column: str, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{where}: {column} must be a list of integers")
    return value


def validate_record(row: Mapping[str, Any], where: str = "record") -> TraceRecord:
    """Check one row against the schema and return it as a :class:`TraceRecord`."""
    prompt, completion = _check_base(row, where)
    has_sdpo = row.get("teacher_prompt") is not None
    has_pair = row.get("chosen") is not None or row.get("rejected") is not None
    if not has_sdpo and not has_pair:
        raise ValueError(
            f"{where}: a record needs channel 2 (teacher_prompt, hint) or channel 3 (chosen, rejected)"
        )
    if has_sdpo:
        _check_teacher_prompt(row, prompt, where)
    _check_token_columns(row, has_sdpo, where)
    if has_pair:
        _check_pair(row, completion, where)
    _check_reference_logps(row, has_pair, where)
    return TraceRecord(**{k: row[k] for k in row if k in _FIELDS})


def _check_base(row: Mapping[str, Any], where: str) -> tuple[list[Message], Message]:
    unknown = set(row) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown columns {sorted(unknown)}")
    for col in ("id", "episode_id", "turn", "prompt", "completion"):
        if row.get(col) is None:
            raise ValueError(f"{where}: missing required column {col!r}")
    if not isinstance(row["turn"], int) or row["turn"] < 0:
        raise ValueError(f"{where}: turn must be a non-negative integer")
    prompt = _messages(row["prompt"], "prompt", where)
    tools = row.get("tools", [])
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError(f"{where}: tools must be a list of OpenAI tool schemas")
    return prompt, _one_assistant(row["completion"], "completion", where)


def _check_teacher_prompt(row: Mapping[str, Any], prompt: list[Message], where: str) -> None:
    """Channel 2: the teacher prompt is the prompt with one hint message inserted at ``hint_index``."""
    teacher = _messages(row["teacher_prompt"], "teacher_prompt", where)
    hint, k = row.get("hint"), row.get("hint_index")
    if not isinstance(hint, str) or not hint.strip() or not isinstance(k, int):
        raise ValueError(f"{where}: teacher_prompt needs a non-empty hint and an integer hint_index")
    if not 0 <= k < len(teacher) or teacher[:k] + teacher[k + 1 :] != prompt or teacher[k].text != hint:
        raise ValueError(
            f"{where}: teacher_prompt must equal prompt with one hint message (text == hint) inserted at hint_index"
        )


def _check_token_columns(row: Mapping[str, Any], has_sdpo: bool, where: str) -> None:
    """Token ids come together, and the SDPO mask is a 0/1 list per completion token."""
    ids_given = [c for c in ("prompt_ids", "completion_ids", "sdpo_mask") if row.get(c) is not None]
    if not ids_given:
        return
    for c in ("prompt_ids", "completion_ids", "sdpo_mask", "tokenizer"):
        if row.get(c) is None:
            raise ValueError(f"{where}: {ids_given} given without {c}; token columns come together")
    completion_ids = _int_list(row["completion_ids"], "completion_ids", where)
    mask = _int_list(row["sdpo_mask"], "sdpo_mask", where)
    _int_list(row["prompt_ids"], "prompt_ids", where)
    if len(mask) != len(completion_ids):
        raise ValueError(
            f"{where}: sdpo_mask has {len(mask)} entries but completion_ids {len(completion_ids)}; "
            "the mask is per completion token"
        )
    if any(v not in (0, 1) for v in mask):
        raise ValueError(f"{where}: sdpo_mask must hold only 0 and 1")
    if not has_sdpo:
        return
    if not any(mask):
        raise ValueError(f"{where}: sdpo_mask is all zero (an SDPO site must mark at least one token)")
    if row.get("teacher_prompt_ids") is None:
        raise ValueError(f"{where}: teacher_prompt given with token ids but without teacher_prompt_ids")
    _int_list(row["teacher_prompt_ids"], "teacher_prompt_ids", where)


def _check_pair(row: Mapping[str, Any], completion: Message, where: str) -> None:
    """Channel 3: chosen and rejected together, different actions, rejected the student's own."""
    if row.get("chosen") is None or row.get("rejected") is None:
        raise ValueError(f"{where}: give chosen and rejected together (channel 3)")
    chosen = _one_assistant(row.get("chosen"), "chosen", where)
    rejected = _one_assistant(row.get("rejected"), "rejected", where)
    from .pairs import action_key

    if action_key(chosen) == action_key(rejected):
        raise ValueError(f"{where}: chosen and rejected are the same action")
    if action_key(rejected) != action_key(completion):
        raise ValueError(f"{where}: rejected must be the student's action (the completion)")


def _check_reference_logps(row: Mapping[str, Any], has_pair: bool, where: str) -> None:
    refs = [row.get("ref_chosen_logp"), row.get("ref_rejected_logp")]
    if (refs[0] is None) != (refs[1] is None):
        raise ValueError(f"{where}: give ref_chosen_logp and ref_rejected_logp together")
    for name, v in zip(("ref_chosen_logp", "ref_rejected_logp"), refs):
        if v is not None and (not isinstance(v, int | float) or not math.isfinite(v)):
            raise ValueError(f"{where}: {name} must be a finite number, got {v!r}")
    if refs[0] is not None and not has_pair:
        raise ValueError(f"{where}: reference log-probs given without chosen/rejected")


def write_records(records: Iterable[TraceRecord], path: str | Path) -> int:
    """Write records as JSONL (``.jsonl``) or Parquet (``.parquet``, needs the ``parquet`` extra)."""
    p = Path(path)
    rows = [validate_record(r.to_dict(), f"record {r.id}").to_dict() for r in records]
    if p.suffix == ".parquet":
        pa, pq = _pyarrow()
        enc = [
            {
                k: (json.dumps(v, ensure_ascii=False) if k in MESSAGE_COLUMNS and v is not None else v)
                for k, v in r.items()
            }
            for r in rows
        ]
        pq.write_table(pa.Table.from_pylist(enc, schema=_arrow_schema(pa)), p)
    else:
        with p.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(rows)


def read_records(path: str | Path) -> list[TraceRecord]:
    """Read and validate records (JSONL or Parquet); errors name the file and row."""
    p = Path(path)
    rows: list[tuple[str, Mapping[str, Any]]] = []
    if p.suffix == ".parquet":
        _, pq = _pyarrow()
        for i, r in enumerate(pq.read_table(p).to_pylist()):
            dec = dict(r)
            for k in MESSAGE_COLUMNS:
                if isinstance(dec.get(k), str):
                    try:
                        dec[k] = json.loads(dec[k])
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{p} row {i}: column {k} is not JSON ({e.msg})") from e
            rows.append((f"{p} row {i}", dec))
    else:
        for n, obj in _json_lines(p):
            if not isinstance(obj, dict):
                raise ValueError(f"{p}:{n}: each line must be a JSON object")
            rows.append((f"{p}:{n}", obj))
    out = [validate_record(r, where) for where, r in rows]
    ids = [r.id for r in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{p}: duplicate record ids")
    return out


def _pyarrow() -> tuple[Any, Any]:
    pq = import_extra("pyarrow.parquet", "Parquet", "parquet")
    return import_extra("pyarrow", "Parquet", "parquet"), pq


def _arrow_schema(pa: Any) -> Any:
    ints, s = pa.list_(pa.int64()), pa.string()
    types: dict[str, Any] = {
        "id": s, "episode_id": s, "turn": pa.int64(), "hint": s, "hint_index": pa.int64(),
        "error_kinds": pa.list_(s), "tokenizer": s, "prompt_ids": ints, "teacher_prompt_ids": ints,
        "completion_ids": ints, "sdpo_mask": ints, "chosen_by": s, "chosen_teachers": pa.list_(s),
        "ref_chosen_logp": pa.float64(), "ref_rejected_logp": pa.float64(),
    }  # fmt: skip
    return pa.schema([(f.name, types.get(f.name, s)) for f in fields(TraceRecord)])


def records_from_rows(rows: Sequence[Mapping[str, Any]]) -> list[TraceRecord]:
    """Validate in-memory rows (e.g. from a ``datasets.Dataset``)."""
    return [validate_record(r, f"row {i}") for i, r in enumerate(rows)]
