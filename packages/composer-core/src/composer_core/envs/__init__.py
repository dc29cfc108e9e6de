"""Environments as the source of tasks, rewards and hints (the README's "Environments"). The adapters are
extras, not imported here: ``composer-core[openenv]`` (:mod:`.openenv`), ``composer-core[verifiers]`` (:mod:`.verifiers`).
"""

from .base import EnvError, Environment, EnvSession, EnvTask, StepResult, prompt_messages
from .digit_reversal import DigitReversalEnv
from .episodes import (
    EnvEpisode,
    episode_error_sites,
    episode_from_steps,
    episode_records,
    feedback_hint,
    run_episode,
)
from .registry import known_schemes, load_env
from .trl_funcs import EnvScorer, env_dataset_rows, env_hint_func, env_reward_func, scorer_for

__all__ = [
    "DigitReversalEnv",
    "EnvEpisode",
    "EnvError",
    "EnvScorer",
    "EnvSession",
    "EnvTask",
    "Environment",
    "StepResult",
    "env_dataset_rows",
    "env_hint_func",
    "env_reward_func",
    "episode_error_sites",
    "episode_from_steps",
    "episode_records",
    "feedback_hint",
    "known_schemes",
    "load_env",
    "prompt_messages",
    "run_episode",
    "scorer_for",
]
