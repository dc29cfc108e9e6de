"""An environment (``composer_core.envs``) as verl's task, reward and channel-2 hint source.

One spec string (``digit-reversal``, ``openenv:<url>``, ``verifiers:<module>``; ``composer_core.envs.load_env``)
drives the data (:func:`write_env_dataset`: verl's RLHF parquet of the environment's tasks, with
``extra_info.task_id`` and the ``chosen``/``rejected`` columns of ``composer.pair_source=dataset``), the reward
(:func:`compute_score`, verl's custom reward function: ``reset(task)`` -> ``step(response)``, its feedback as
``feedback``) and the hint (``composer.env=<spec>``: :func:`env_hint_fn`). Every process loads the environment
once per spec; an environment fault raises ``composer_core.envs.EnvError``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_verl.config import HintFn

__all__ = ["compute_score", "env_hint_fn", "env_rows", "load", "write_env_dataset"]


@functools.cache
def load(spec: str) -> Any:
    """``composer_core.envs.load_env(spec)``, once per process."""
    from composer_core.envs import load_env

    return load_env(spec)


def env_rows(
    spec: str,
    split: str = "train",
    limit: int | None = None,
    pair_columns: Sequence[str] = ("chosen", "rejected"),
) -> list[dict[str, Any]]:
    """verl RLHF rows (``data_source`` = the spec) of the environment's tasks (see the module docstring);
    ``pair_columns=("chosen",)`` for ``composer.replay_pairs=on_policy`` (the rejected side is the student's)."""
    from composer_core.envs import env_dataset_rows

    rows = []
    for r in env_dataset_rows(load(spec), split, limit):
        prompt = [{"role": "user", "content": r["prompt"]}] if isinstance(r["prompt"], str) else r["prompt"]
        row: dict[str, Any] = {
            "data_source": spec,
            "prompt": prompt,
            "ability": "env",
            "reward_model": {"style": "env", "ground_truth": r.get("chosen") or ""},
            "extra_info": {"task_id": r["task_id"], "env": spec},
        }
        row.update({k: r[k] for k in pair_columns if k in r})
        rows.append(row)
    return rows


def write_env_dataset(
    spec: str,
    path: str | Path,
    split: str = "train",
    limit: int | None = None,
    pair_columns: Sequence[str] = ("chosen", "rejected"),
) -> Path:
    """:func:`env_rows` as a parquet file (verl's ``data.train_files``)."""
    import pandas as pd  # type: ignore[import-untyped, unused-ignore]  # a dependency of verl

    pd.DataFrame(env_rows(spec, split, limit, pair_columns)).to_parquet(path)
    return Path(path)


def _task_id(extra_info: Any) -> str:
    if not isinstance(extra_info, Mapping) or "task_id" not in extra_info:
        raise ValueError(
            "the row has no extra_info.task_id: build the data with composer_verl.envs.write_env_dataset(spec, path)"
        )
    return str(extra_info["task_id"])


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any = None,
    extra_info: Any = None,
    env: str | None = None,
    **_: Any,
) -> dict[str, Any]:
    """verl's reward-function signature: ``{"score": the environment's reward, "feedback": its text or ""}``.

    ``env``: the spec (``reward_kwargs.env``); default: the row's ``extra_info.env``, else ``data_source``.
    """
    from composer_core.envs import scorer_for

    spec = env or (extra_info or {}).get("env") or data_source
    result = scorer_for(load(spec)).score(_task_id(extra_info), solution_str)
    return {"score": float(result.reward), "feedback": result.feedback or ""}


def env_hint_fn(spec: str) -> HintFn:
    """``hint_fn(prompt, response, reward, extra)``: the environment's feedback on ``response`` (None: no hint)."""
    from composer_core.envs import env_hint_func

    hints = env_hint_func(load(spec))

    def hint_fn(prompt: str, response: str, reward: float, extra: Mapping[str, Any]) -> str | None:
        return hints([prompt], [response], task_id=[_task_id(extra.get("extra_info"))])[0]

    return hint_fn
