"""Token data: deterministic micro-batches addressed by a global batch index.

Batch ``k`` is a pure function of ``(data, seed, micro_batch_size, k)``: epoch
``e = k // batches_per_epoch`` uses the permutation ``randperm(n, seed + e)``. Resuming at
``batches_consumed`` therefore continues with exactly the next batch, with no sampler state.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor


def load_tokens(path: str | Path, key: str = "input_ids") -> Tensor:
    """Load ``[num_sequences, seq_len]`` token ids from a safetensors file."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data.path={str(p)!r} does not exist")
    try:
        tensors = load_file(str(p))
    except Exception as exc:  # safetensors raises its own error types
        raise ValueError(f"data.path={str(p)!r} is not a readable safetensors file: {exc}") from exc
    if key not in tensors:
        raise ValueError(f"{p} has no tensor {key!r} (found {sorted(tensors)})")
    return tensors[key]


def synthetic_tokens(vocab_size: int, num_sequences: int, seq_len: int, seed: int = 0) -> Tensor:
    """Random token ids (for smoke runs and benchmarks; carries no language signal)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_sequences, seq_len), generator=g)


class TokenBatches:
    """Train/validation split (the last ``val_sequences`` rows are held out) and batch lookup."""

    def __init__(
        self, input_ids: Tensor, *, micro_batch_size: int, seed: int, val_sequences: int = 0
    ) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"input_ids must be a 2-D integer tensor [num_sequences, seq_len], got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        n_train = input_ids.shape[0] - val_sequences
        if n_train < micro_batch_size:
            raise ValueError(
                f"{input_ids.shape[0]} sequences minus val_sequences={val_sequences} leaves {n_train} for training, "
                f"fewer than micro_batch_size={micro_batch_size}"
            )
        if int(input_ids.min()) < 0:
            raise ValueError("input_ids contains negative token ids")
        self.train = input_ids[:n_train].long()
        self.val = input_ids[n_train:].long()
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.per_epoch = n_train // micro_batch_size
        self._perm: tuple[int, Tensor] | None = None

    def batch(self, index: int) -> Tensor:
        """Micro-batch number ``index`` (0-based, counting every micro-batch ever drawn)."""
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        epoch, pos = divmod(index, self.per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.train.shape[0], generator=g))
        rows = self._perm[1][pos * self.micro_batch_size : (pos + 1) * self.micro_batch_size]
        return self.train[rows]

    def val_batches(self) -> list[Tensor]:
        """Held-out micro-batches (the last one may be smaller)."""
        return [
            self.val[i : i + self.micro_batch_size]
            for i in range(0, self.val.shape[0], self.micro_batch_size)
        ]
