"""Environments as the source of tasks, rewards and hints (issue 18).

- :mod:`.base`: the contract (:class:`EnvTask`, :class:`StepResult`, :class:`EnvSession`,
  :class:`Environment`, :class:`EnvError`);
- :mod:`.episodes`: :func:`run_episode` (multi-turn, bounded by ``timeout_s``, faults recorded as failed
  episodes), error sites at the feedback turns, the feedback as a channel-2 hint source, training records
  (the reference answer as channel 3's ``chosen``);
- :mod:`.registry`: :func:`load_env` (``digit-reversal``, ``openenv:<url>``, ``verifiers:<module>``,
  entry-point schemes);
- :mod:`.trl_funcs`: dataset rows, reward and hint functions in TRL's calling convention;
- :mod:`.digit_reversal`: the embedded task as an in-process environment.

Adapters are extras: ``composer-core[openenv]`` (:mod:`.openenv`), ``composer-core[verifiers]``
(:mod:`.verifiers`); they are not imported here.
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
