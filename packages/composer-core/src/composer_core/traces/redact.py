"""Redaction of API keys in text taken from a teacher's response (:mod:`composer_core.traces.replay`).

Every form a key can take in a body (raw, URL-encoded, JSON-escaped, base64 at every alignment) is found, and
every run of >= ``MIN_SECRET_CHARS`` characters that is part of one becomes ``***``; redact *before* cutting.
"""

from __future__ import annotations

import base64
import functools
import json
import urllib.parse
from collections.abc import Sequence
from typing import Any

__all__ = ["MIN_SECRET_CHARS", "redact", "redact_strings"]

MIN_SECRET_CHARS = 8  # runs of a key's characters at least this long are redacted
_MAX_SECRET_HITS = 8192


def _secret_forms(secret: str) -> set[str]:
    """The key as it can appear in a body: raw, URL-encoded, JSON-escaped, base64 at every alignment."""
    forms = {secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret)}
    forms.add(json.dumps(secret)[1:-1])
    raw = secret.encode()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        for shift in range(3):  # the key after 0, 1 or 2 other bytes (e.g. "Bearer ", "user:")
            text = encode(b"\0" * shift + raw).decode().rstrip("=")
            forms.add(text[4 if shift else 0 :])  # drop the group that mixes in the other bytes
    return forms


@functools.lru_cache(maxsize=64)
def _redactor(secrets: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(forms >= MIN_SECRET_CHARS, their 4-grams at offsets 0, 4, 8, ..., shorter forms)."""
    forms = sorted({f for s in secrets for f in _secret_forms(s)}, key=len, reverse=True)
    long_forms = tuple(f for f in forms if len(f) >= MIN_SECRET_CHARS)
    # any run of >= 8 characters of a form contains one of its 4-grams that starts at a multiple of 4
    anchors = tuple(sorted({f[i : i + 4] for f in long_forms for i in range(0, len(f) - 3, 4)}))
    return long_forms, anchors, tuple(f for f in forms if len(f) < MIN_SECRET_CHARS)


def _grow(text: str, start: int, end: int, forms: Sequence[str], right_first: bool) -> tuple[int, int]:
    """Widen ``text[start:end]`` (part of a form) by bisection as far as it stays part of some form."""
    longest = max(map(len, forms))

    def part(a: int, b: int) -> bool:
        return any(text[a:b] in f for f in forms)

    for side in ("right", "left") if right_first else ("left", "right"):
        if side == "right":
            lo, hi = end, min(len(text), start + longest)  # text[start:lo] is part of a form
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if part(start, mid) else (lo, mid - 1)
            end = lo
        else:
            lo, hi = max(0, end - longest), start  # text[hi:end] is part of a form
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if part(mid, end) else (mid + 1, hi)
            start = hi
    return start, end


def redact(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every form of every secret (see the module docstring) replaced by ``***``.

    Any run of >= ``MIN_SECRET_CHARS`` characters that is part of a form is removed, so a prefix or
    suffix of a key is caught too. Redact *before* cutting.
    """
    uniq = tuple(sorted({s for s in secrets if s}))
    if not uniq or not text:
        return text
    forms, anchors, short = _redactor(uniq)
    hits = []
    for anchor in anchors:
        hit = text.find(anchor)
        while hit != -1:
            hits.append(hit)
            if len(hits) > _MAX_SECRET_HITS:  # a body made of keys: drop it whole rather than burn CPU
                return "*** (redacted whole: it holds too many copies of an API key)"
            hit = text.find(anchor, hit + 1)
    merged: list[list[int]] = []
    for hit in sorted(set(hits)):
        if merged and hit + 4 <= merged[-1][1]:
            continue  # inside a span already found
        for right_first in (True, False):  # both ways round: the union covers the whole run
            a, b = _grow(text, hit, hit + 4, forms, right_first)
            if b - a < MIN_SECRET_CHARS:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1] = [min(merged[-1][0], a), max(merged[-1][1], b)]
            else:
                merged.append([a, b])
    pieces, pos = [], 0
    for a, b in merged:
        pieces += [text[pos:a], "***"]
        pos = b
    text = "".join(pieces) + text[pos:]
    for f in short:  # keys shorter than MIN_SECRET_CHARS: exact matches only
        text = text.replace(f, "***")
    return text


def redact_strings(value: Any, secrets: Sequence[str]) -> Any:
    """Redact every string (keys included) inside a JSON value."""
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, list):
        return [redact_strings(v, secrets) for v in value]
    if isinstance(value, dict):
        return {redact(str(k), secrets): redact_strings(v, secrets) for k, v in value.items()}
    return value
