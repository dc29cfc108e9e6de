"""``keys_to_learn``: which parameters of each student block train.

``entire_block`` trains every floating-point parameter of the block; ``subblock_attention``,
``subblock_ffn`` and ``subblock_mamba`` train that subblock (its norm and its module).
Everything else, and every non-floating-point parameter, is frozen.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from composer_core.bypass.protocol import BlockwiseModel

KEYS = ("entire_block", "subblock_attention", "subblock_ffn", "subblock_mamba")


def canonical_keys(keys: str | Sequence[str]) -> tuple[str, ...]:
    """Validate and canonicalise (sort, de-duplicate) ``keys_to_learn``.

    The canonical form goes into the run identity, so ``["subblock_ffn",
    "subblock_attention"]`` and its reverse name the same run.
    """
    items = [keys] if isinstance(keys, str) else list(keys)
    if not items:
        raise ValueError(f"keys_to_learn is empty; give one or more of {KEYS}")
    unknown = [k for k in items if k not in KEYS]
    if unknown:
        raise ValueError(f"keys_to_learn has unknown entries {unknown}; allowed: {KEYS}")
    canon = tuple(sorted(set(items)))
    if "entire_block" in canon and len(canon) > 1:
        raise ValueError(
            f"keys_to_learn={list(items)}: 'entire_block' already trains every subblock and cannot be mixed with others"
        )
    return canon


def check_keys_for_model(model: BlockwiseModel, keys: Sequence[str]) -> None:
    """Raise when a requested subblock kind exists in no block of the model (never train a fallback)."""
    present = {kind for i in range(model.num_blocks) for kind in model.subblocks(i)}
    for key in keys:
        if key == "entire_block":
            continue
        kind = key.removeprefix("subblock_")
        if kind not in present:
            raise ValueError(
                f"keys_to_learn contains {key!r} but no student block has a {kind} subblock "
                f"(present: {sorted(present) or 'none'}); drop it or use 'entire_block'"
            )


def trainable_parameters(
    model: BlockwiseModel, index: int, keys: Sequence[str]
) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs of block ``index`` selected by canonical ``keys``."""
    block = model.block(index)
    if "entire_block" in keys:
        chosen = {id(p) for p in block.parameters()}
    else:
        subs = model.subblocks(index)
        chosen = set()
        for key in keys:
            for module in subs.get(key.removeprefix("subblock_"), []):
                chosen.update(id(p) for p in module.parameters())
    return [(n, p) for n, p in block.named_parameters() if id(p) in chosen and p.is_floating_point()]


def freeze_for_training(
    model: BlockwiseModel, blocks: Sequence[int], keys: Sequence[str]
) -> dict[int, list[nn.Parameter]]:
    """Freeze the whole model, then unfreeze the selected parameters of ``blocks``."""
    model.module.requires_grad_(False)
    out = {i: [p for _, p in trainable_parameters(model, i, keys)] for i in blocks}
    for params in out.values():
        for p in params:
            p.requires_grad_(True)
    return out
