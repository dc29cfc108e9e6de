"""What would hang a run or leave it half made, refused in one line (issue 50): prompts longer than the model's
context (TRL 1.16 does not truncate them) and reward functions that fail (they raise, return the wrong number or kind
of rewards, an infinite one, or no finite reward for a whole batch). What each refusal says: the package README's
"Exit codes and what is kept" (*Prompt length*, *Reward functions*).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

TRL_NONE_WARNING = "All reward functions returned None"


class RewardFunctionError(RuntimeError):
    """A reward function raised, returned the wrong number or kind of rewards, or no completion of a generation
    batch got a reward from any function. ``str(e)`` is one line; ``__cause__`` holds the function's own error."""


# ---------------------------------------------------------------------------------------------- prompt length


def context_length(model_config: Any) -> int | None:
    """``max_position_embeddings`` of a model config (its text config for a VLM); None when it has none."""
    cfg = model_config
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        cfg = get_text()
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def prompt_lengths(
    tokenizer: Any, prompts: Sequence[Any], chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """Token counts of ``prompts`` as TRL 1.16's ``GRPOTrainer._tokenize_prompts`` tokenizes them (text: the
    tokenizer with its special tokens; messages: the chat template with the generation prompt)."""
    if not prompts:
        return []
    if isinstance(prompts[0], list):  # conversational
        ids = tokenizer.apply_chat_template(
            conversation=list(prompts),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(chat_template_kwargs or {}),
        )["input_ids"]
    else:
        ids = tokenizer(text=list(prompts))["input_ids"]
    return [len(x) for x in ids]


def overlong_prompt(lengths: Sequence[int], max_completion_length: int, context: int) -> int | None:
    """Index of the first prompt whose length + ``max_completion_length`` exceeds ``context`` (None: all fit)."""
    for i, n in enumerate(lengths):
        if n + max_completion_length > context:
            return i
    return None


def prompt_too_long_message(where: str, n_tokens: int, max_completion_length: int, context: int) -> str:
    """The one line: ``where`` names the row (``train_dataset row 3``, ``--dataset_name 'x.jsonl' row 3``)."""
    room = context - max_completion_length
    fix = f"shorten it to at most {room} tokens or drop the row" if room > 0 else "drop the row"
    if n_tokens < context:
        fix += f", or lower max_completion_length to {context - n_tokens}"
    return (
        f"{where}: the prompt is {n_tokens} tokens; with max_completion_length={max_completion_length} that is "
        f"{n_tokens + max_completion_length} positions, but the model's context is {context} "
        f"(max_position_embeddings); {fix} (TRL 1.16 does not truncate prompts)."
    )


def generation_context(trainer: Any) -> int | None:
    """The longest sequence the trainer's generator takes, as TRL 1.16's tool loop reads it: vLLM's
    ``max_model_len`` when vLLM generates in-process, else the policy's ``max_position_embeddings``."""
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_mode", None) == "colocate":
        try:
            return int(trainer.vllm_generation.llm.llm_engine.model_config.max_model_len)
        except AttributeError:
            pass
    return context_length(trainer.model.config)


def check_batch_prompts(trainer: Any, prompts: Sequence[Any], prompt_ids: Sequence[Sequence[int]]) -> None:
    """Raise ``ValueError`` (:func:`prompt_too_long_message`) for the first prompt of a generation batch whose
    tokens + ``max_completion_length`` exceed the generator's context, before anything is generated."""
    context = generation_context(trainer)
    if context is None:
        return
    m = int(trainer.max_completion_length or 0)
    i = overlong_prompt([len(ids) for ids in prompt_ids], m, context)
    if i is None:
        return
    row = row_indices(trainer.train_dataset, [prompts[i]])[0]
    where = f"train_dataset row {row}" if row is not None else f"prompt {i} of the generation batch"
    raise ValueError(prompt_too_long_message(where, len(prompt_ids[i]), m, context))


def row_indices(dataset: Any, prompts: Sequence[Any]) -> list[int | None]:
    """The dataset row of each prompt (its first row with that prompt; None: not found or no ``prompt`` column).
    Only called on an error path: it reads the dataset's whole ``prompt`` column."""
    try:
        column = dataset["prompt"]
    except Exception:  # no dataset, an IterableDataset, no prompt column
        return [None] * len(prompts)
    first: dict[str, int] = {}
    for i, p in enumerate(column):
        first.setdefault(repr(p), i)
    return [first.get(repr(p)) for p in prompts]


# ---------------------------------------------------------------------------------------------- reward functions


def reward_func_label(func: Any, name: str) -> str:
    """``module:function`` as ``--reward_funcs`` takes it (TRL's name when the callable has no module)."""
    while isinstance(func, functools.partial):
        func = func.func
    target = func if inspect.isfunction(func) or inspect.ismethod(func) else type(func)
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if not module or not qualname or module == "builtins":
        return name
    return f"{module}:{qualname}"


def _rows_text(rows: Sequence[int | None], limit: int = 8) -> str:
    unique: list[int] = []
    for r in rows:
        if r is not None and r not in unique:
            unique.append(r)
    if not unique:
        return "rows not found in the training dataset"
    shown = ", ".join(str(r) for r in unique[:limit])
    more = f", … ({len(unique)} prompts)" if len(unique) > limit else ""
    return f"dataset rows {shown}{more}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _check_output(output: Any, n: int) -> list[Any]:
    """``output`` as a list (a generator is read once here), if it holds ``n`` numbers or Nones."""
    try:
        values = list(output)
    except TypeError:
        raise RewardFunctionError(
            f"returned {type(output).__name__}, not a list of {n} rewards (one per completion)"
        ) from None
    if len(values) != n:
        raise RewardFunctionError(f"returned {len(values)} rewards for {n} completions (one per completion)")
    for v in values:
        if v is not None and not isinstance(v, int | float) and not hasattr(v, "__float__"):
            raise RewardFunctionError(f"returned a {type(v).__name__} ({v!r:.40}), not a number or None")
        if v is not None and math.isinf(float(v)):  # an inf reward makes every advantage of its group NaN
            raise RewardFunctionError(
                f"returned {float(v)} (a reward must be finite; None or NaN skips a completion)"
            )
    return values


@contextmanager
def guarded_reward_funcs(trainer: Any, rows: Callable[[], Sequence[int | None]], step: str) -> Iterator[None]:
    """Within the block, each of ``trainer.reward_funcs`` that is a plain or async callable (reward models are left
    as they are) raises :class:`RewardFunctionError` naming itself, ``step`` and the batch's dataset rows when it
    raises or returns the wrong number or kind of rewards. ``rows()`` is called on the error path only."""
    import torch
    from trl.trainer.utils import is_async_callable

    originals = list(trainer.reward_funcs)
    names = list(trainer.reward_func_names)

    def fail(label: str, what: str, cause: BaseException | None) -> RewardFunctionError:
        err = RewardFunctionError(f"reward function {label} {what} ({step}, {_rows_text(rows())})")
        err.__cause__ = cause
        return err

    def wrap(func: Any, name: str) -> Any:
        label = reward_func_label(func, name)

        def check(output: Any, n: int) -> list[Any]:
            try:
                return _check_output(output, n)
            except RewardFunctionError as e:
                raise fail(label, str(e), None) from None

        if is_async_callable(func):

            async def guarded_async(*args: Any, **kwargs: Any) -> Any:
                try:
                    output = await func(*args, **kwargs)
                except Exception as e:
                    raise fail(label, f"raised {_first_line(e)}", e) from e
                return check(output, len(kwargs.get("prompts", ())))

            return guarded_async

        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                output = func(*args, **kwargs)
            except Exception as e:
                raise fail(label, f"raised {_first_line(e)}", e) from e
            return check(output, len(kwargs.get("prompts", ())))

        return guarded

    trainer.reward_funcs = [
        f if isinstance(f, torch.nn.Module) else wrap(f, n) for f, n in zip(originals, names, strict=True)
    ]
    try:
        yield
    finally:
        trainer.reward_funcs = originals


def check_scored(
    rewards_per_func: Any, labels: Sequence[str], rows: Callable[[], Sequence[int | None]], step: str
) -> None:
    """Raise :class:`RewardFunctionError` for a generation batch in which no completion got a finite reward from
    any function (every row TRL's "All reward functions returned None" case)."""
    import torch

    if rewards_per_func.numel() == 0 or not bool(torch.isnan(rewards_per_func).all()):
        return
    who = ", ".join(labels)
    raise RewardFunctionError(
        f"no completion of the generation batch got a reward: {who} returned None/NaN for all "
        f"{rewards_per_func.shape[0]} completions ({step}, {_rows_text(rows())}); return a number for the "
        "completions you can score"
    )


@contextmanager
def deferred_trl_none_warning() -> Iterator[None]:
    """Hold TRL's "All reward functions returned None" warning (GRPOTrainer's logger) for the block and log it as
    TRL would have when the block ends normally; a block that raises (one line instead) drops it."""
    log = logging.getLogger("trl.trainer.grpo_trainer")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        if TRL_NONE_WARNING in str(record.msg):
            held.append(record)
            return False
        return True

    log.addFilter(hold)
    try:
        yield
    finally:
        log.removeFilter(hold)
    for record in held:
        log.handle(record)
