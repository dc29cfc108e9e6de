"""Chunk geometry of the full-vocabulary losses (:mod:`composer_core.loss.distill`): rows per chunk from the
vocabulary size V and the form (logits or fused LM head), and the check of a given ``chunk_size``."""

from __future__ import annotations

__all__ = ["CHUNK_LOGITS", "FUSED_CHUNK_LOGITS", "FUSED_MIN_ROWS", "check_chunk_size", "chunk_rows"]

#: Logits per chunk of the logits-input losses at the default ``chunk_size`` (None): ``max(1, CHUNK_LOGITS // V)``
#: rows, so the ~four chunk × V work buffers stay ≈ 0.5 GB whatever V (``bench/bench_jsd.py``).
CHUNK_LOGITS = 1024 * 32_768

#: Logits per chunk of the fused (LM-head) losses at the default ``chunk_size``:
#: ``max(FUSED_MIN_ROWS, FUSED_CHUNK_LOGITS // V)`` rows, 256 from V = 32,768 up (about a third of Liger-Kernel's
#: fused JSD memory at its 1024 rows).
FUSED_CHUNK_LOGITS = 256 * 32_768

#: Rows the fused default never goes below: thinner chunks re-read the LM head for matmuls too short to pay.
FUSED_MIN_ROWS = 256


def chunk_rows(chunk_size: int | None, vocab: int, *, fused: bool) -> int:
    """Rows (tokens) per chunk over a vocabulary of ``vocab``: ``chunk_size``, or for None (the default)
    ``max(FUSED_MIN_ROWS, FUSED_CHUNK_LOGITS // vocab)`` in the fused form, ``max(1, CHUNK_LOGITS // vocab)`` on
    logits."""
    if chunk_size is not None:
        return chunk_size
    return max(FUSED_MIN_ROWS, FUSED_CHUNK_LOGITS // vocab) if fused else max(1, CHUNK_LOGITS // vocab)


def check_chunk_size(name: str, chunk_size: object) -> None:
    """``chunk_size`` is None (rows from V: :func:`chunk_rows`) or an int >= 1; raises naming ``name``."""
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            f"`{name}`={chunk_size!r} must be an int >= 1 (rows of B·T processed at once) or None (the default: "
            f"{CHUNK_LOGITS:,} // V rows on logits, max({FUSED_MIN_ROWS}, {FUSED_CHUNK_LOGITS:,} // V) fused)."
        )
