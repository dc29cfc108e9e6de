"""Build a student from a teacher and initialise it from the teacher's weights.

Per-block overrides give the student's block configs; :func:`build_student` creates the student and copies /
shrinks the teacher's weights (Puzzle, arXiv 2411.19146; Model-Optimizer ``mlp_init_mode`` / ``gqa_init_mode``):
FFN ``truncate`` keeps the first ``k`` intermediate channels, ``importance`` the ``k`` with the largest
``s_j = sqrt(mean_tokens a_j²)``, ``a`` the ``down_proj`` input on calibration batches (Minitron, arXiv
2407.14679), in their original order; KV head ``h`` is the mean of teacher heads ``h·g … h·g+g−1``, ``g =
n_teacher/n_student`` (``average``, GQA uptraining, Ainslie et al. 2023) or the first of them (``first``).
Initialisation needs the Llama module layout (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``); a
subblock whose mixer kind changes (attention → mamba) keeps its fresh initialisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal, cast

import torch
from torch import Tensor, nn

from composer_core.bypass.distributed import DistContext, Ownership
from composer_core.bypass.forward import teacher_forward
from composer_core.bypass.protocol import BlockConfig, BlockOverride, BlockwiseModel, resolve_block_configs
from composer_core.bypass.shard import TensorSource, source_of

MlpInit = Literal["truncate", "importance"]
GqaInit = Literal["average", "first"]

_FFN_ROWS = ("mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight", "mlp.up_proj.bias")
_FFN_COLS = ("mlp.down_proj.weight",)
_KV = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")


def build_student(
    teacher: BlockwiseModel,
    overrides: Sequence[BlockOverride],
    *,
    mlp_init_mode: MlpInit = "truncate",
    gqa_init_mode: GqaInit = "average",
    calibration: Iterable[Tensor] | None = None,
    ownership: Ownership | None = None,
    ctx: DistContext | None = None,
) -> BlockwiseModel:
    """Create the student (teacher + ``overrides``) and initialise it from the teacher.

    With ``ownership`` only the owned blocks (+ embedding on the first rank, final norm and head
    on the last) get storage, initialised from the teacher's tensors read through its source
    (:func:`~composer_core.bypass.shard.source_of`); importance scores then come from a
    pipelined teacher pass over the owned blocks (every rank of ``ctx`` takes part).
    """
    if mlp_init_mode not in ("truncate", "importance"):
        raise ValueError(f"mlp_init_mode={mlp_init_mode!r} is unknown; choose 'truncate' or 'importance'")
    if gqa_init_mode not in ("average", "first"):
        raise ValueError(f"gqa_init_mode={gqa_init_mode!r} is unknown; choose 'average' or 'first'")
    configs = resolve_block_configs(teacher.block_configs(), overrides)
    student = teacher.with_block_configs(configs, ownership)
    importance = None
    if mlp_init_mode == "importance":
        if calibration is None:
            raise ValueError(
                "mlp_init_mode='importance' needs calibration batches (token ids) to score FFN channels"
            )
        blocks = ownership.blocks if ownership else range(teacher.num_blocks)
        importance = ffn_channel_importance(teacher, calibration, blocks, ctx or DistContext())
    init_from_teacher(student, teacher, importance=importance, gqa_init_mode=gqa_init_mode)
    return student


@torch.no_grad()
def ffn_channel_importance(
    teacher: BlockwiseModel,
    batches: Iterable[Tensor],
    blocks: Iterable[int] | None = None,
    ctx: DistContext | None = None,
) -> dict[int, Tensor]:
    """Per-block ``sqrt(mean a_j²)`` of the FFN intermediate activations (input of ``down_proj``).

    Scores ``blocks`` (default: all) with a pipelined teacher pass (every rank of ``ctx`` calls it).
    """
    owned = list(range(teacher.num_blocks) if blocks is None else blocks)
    sums: dict[int, Tensor] = {}
    counts: dict[int, int] = {}
    handles = []
    for i in owned:
        down = getattr(getattr(teacher.block(i), "mlp", None), "down_proj", None)
        if not isinstance(down, nn.Module):
            continue

        def hook(_m: nn.Module, args: tuple[Tensor, ...], i: int = i) -> None:
            a = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[i] = sums.get(i, torch.zeros(a.shape[-1], device=a.device)) + a.pow(2).sum(0)
            counts[i] = counts.get(i, 0) + a.shape[0]

        handles.append(down.register_forward_pre_hook(hook))
    try:
        n = 0
        for ids in batches:
            teacher_forward(teacher, ids, owned, ctx or DistContext())
            n += 1
        if n == 0:
            raise ValueError("calibration yielded no batches; activation importance needs at least one")
    finally:
        for h in handles:
            h.remove()
    return {i: (sums[i] / counts[i]).sqrt() for i in sums}


def _average_kv(t: Tensor, n_teacher: int, n_student: int, mode: GqaInit) -> Tensor:
    if n_teacher % n_student:
        raise ValueError(
            f"cannot initialise {n_student} KV heads from {n_teacher}: the student count must divide the teacher's"
        )
    g = n_teacher // n_student
    grouped = t.reshape(n_student, g, t.shape[0] // n_teacher, *t.shape[1:])
    return (grouped.mean(1) if mode == "average" else grouped[:, 0]).reshape(-1, *t.shape[1:])


@torch.no_grad()
def init_from_teacher(
    student: BlockwiseModel,
    teacher: BlockwiseModel,
    *,
    importance: dict[int, Tensor] | None = None,
    gqa_init_mode: GqaInit = "average",
    source: TensorSource | None = None,
) -> None:
    """Copy the teacher's weights into ``student``, shrinking FFN channels and KV heads.

    Only the student's materialised tensors are written; teacher tensors not materialised on
    this rank are read from ``source`` (default: :func:`~composer_core.bypass.shard.source_of`).
    """
    if student.num_blocks != teacher.num_blocks:
        raise ValueError(
            f"student has {student.num_blocks} blocks but the teacher has {teacher.num_blocks}; they must match"
        )
    s_state = {k: v for k, v in student.module.state_dict().items() if not v.is_meta}
    t_skeleton = teacher.module.state_dict()
    src = source or source_of(teacher)

    def read(name: str) -> Tensor | None:
        """The teacher's tensor ``name`` (read from ``src`` if not materialised here); None if it has none."""
        t = t_skeleton.get(name)
        return src.get(name).to(t.dtype) if t is not None and t.is_meta else t

    block_prefixes = tuple(student.block_prefix(i) for i in range(student.num_blocks))
    for name, tensor in s_state.items():
        if name.startswith(block_prefixes):
            continue
        if name not in t_skeleton or t_skeleton[name].shape != tensor.shape:
            raise ValueError(f"student parameter {name!r} has no teacher counterpart of the same shape")
        tensor.copy_(cast(Tensor, read(name)))
    s_cfgs, t_cfgs = student.block_configs(), teacher.block_configs()
    for i in range(student.num_blocks):
        _init_block(student, teacher, i, (s_cfgs[i], t_cfgs[i]), s_state, read, importance, gqa_init_mode)


def _init_block(
    student: BlockwiseModel,
    teacher: BlockwiseModel,
    i: int,
    cfgs: tuple[BlockConfig, BlockConfig],
    s_state: dict[str, Tensor],
    read: Callable[[str], Tensor | None],
    importance: dict[int, Tensor] | None,
    gqa_init_mode: GqaInit,
) -> None:
    """Block ``i`` of the student from the teacher's: copied, FFN channels selected, KV heads averaged; a mixer
    whose kind changed keeps its fresh init."""
    s_cfg, t_cfg = cfgs
    prefix, t_prefix = student.block_prefix(i), teacher.block_prefix(i)
    same_mixer = s_cfg.attention.mixer == t_cfg.attention.mixer and not t_cfg.attention.no_op
    n_t = t_cfg.attention.num_key_value_heads or 0
    n_s = s_cfg.attention.num_key_value_heads or 0
    channels: Tensor | None = None
    for name, tensor in s_state.items():
        if not name.startswith(prefix):
            continue
        local = name[len(prefix) :]
        t_tensor = read(t_prefix + local)
        is_mixer = local.startswith(("self_attn.", "mamba.", "input_layernorm."))
        if t_tensor is None or (is_mixer and not same_mixer):
            continue  # new module (mixer kind changed): keep its fresh init
        if t_tensor.shape == tensor.shape:
            tensor.copy_(t_tensor)
        elif local in _FFN_ROWS or local in _FFN_COLS:
            if channels is None:
                k = s_cfg.ffn.intermediate_size or 0
                channels = _select_channels(importance, i, t_tensor.shape[0 if local in _FFN_ROWS else 1], k)
            tensor.copy_(t_tensor[channels] if local in _FFN_ROWS else t_tensor[:, channels])
        elif local in _KV:
            tensor.copy_(_average_kv(t_tensor, n_t, n_s, gqa_init_mode))
        else:
            raise ValueError(
                f"cannot initialise student {name!r} {tuple(tensor.shape)} from teacher {tuple(t_tensor.shape)}"
            )


def _select_channels(importance: dict[int, Tensor] | None, block: int, width: int, k: int) -> Tensor:
    if k > width:
        raise ValueError(f"block {block}: student intermediate_size={k} exceeds the teacher's {width}")
    if importance is None:
        return torch.arange(k)
    if block not in importance:
        raise ValueError(f"block {block}: no activation importance recorded (its teacher FFN is a no-op?)")
    return torch.topk(importance[block], k).indices.sort().values.cpu()
