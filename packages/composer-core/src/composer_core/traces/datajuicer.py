"""Run py-data-juicer Filter and Deduplicator ops over typed preference pairs, flattened to text columns (the
package README's "Pairs are typed"); ``Mapper`` ops raise. Requires ``pip install 'composer-core[datajuicer]'``
(py-data-juicer plus the ``aiohttp`` and ``ray`` it imports without declaring).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .hints import render_plain
from .pairs import PreferencePair
from .schema import Message, import_extra

__all__ = ["action_text", "datajuicer_filter"]

_ID = "composer_pair_index"


def action_text(m: Message) -> str:
    """The text data-juicer ops see for one action."""
    if not isinstance(m, Message):
        raise TypeError(f"action_text takes a Message, got {type(m).__name__}")
    lines = [m.text] if m.text else []
    lines += [f"{c.name} {c.arguments}" for c in m.tool_calls]
    return "\n".join(lines)


def _dj() -> tuple[Any, Any, tuple[type, ...], type]:
    data, ops, base = (
        import_extra(f"data_juicer.{m}", "the data-juicer integration", "datajuicer")
        for m in ("core.data", "ops", "ops.base_op")
    )
    return data.NestedDataset, ops.load_ops, (base.Filter, base.Deduplicator), base.Mapper


def datajuicer_filter(
    pairs: Sequence[PreferencePair],
    process: Sequence[Mapping[str, Mapping[str, Any]] | Any],
    *,
    num_proc: int = 1,
) -> tuple[list[PreferencePair], int]:
    """Apply data-juicer ops in order; return the surviving pairs (input order) and the drop count.

    ``process``: op instances, or config entries such as ``{"text_length_filter": {"max_len": 4000}}``
    (``num_proc`` filled in unless set).
    """
    nested_dataset, load_ops, allowed, mapper = _dj()
    for i, p in enumerate(pairs):
        if not isinstance(p, PreferencePair):
            raise TypeError(f"pairs[{i}] must be a PreferencePair, got {type(p).__name__}")
    ops: list[Any] = []
    for entry in process:
        if isinstance(entry, Mapping):
            if len(entry) != 1:
                raise ValueError(f"a process entry maps one op name to its arguments, got {dict(entry)}")
            ((name, args),) = entry.items()
            ops += load_ops([{name: {"num_proc": num_proc, **dict(args or {})}}])
        else:
            ops.append(entry)
    for op in ops:
        if isinstance(op, mapper) or not isinstance(op, allowed):
            raise ValueError(
                f"{type(op).__name__} is not a data-juicer Filter or Deduplicator; only ops that keep or drop "
                "whole rows can be mapped back to typed pairs"
            )
    if not pairs:
        return [], 0
    rows = [
        {
            _ID: i,
            "text": action_text(p.chosen),
            "rejected_text": action_text(p.rejected),
            "prompt_text": render_plain(p.prompt),
        }
        for i, p in enumerate(pairs)
    ]
    ds = nested_dataset.from_list(rows)
    for op in ops:
        ds = op.run(ds)
    kept = sorted(int(r[_ID]) for r in ds.to_list())
    return [pairs[i] for i in kept], len(pairs) - len(kept)
