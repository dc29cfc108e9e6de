"""Channel-2 producer on PRIME-RL's orchestrator: hinted self-scoring routed to the rl loss.

PRIME-RL's (559b447) ``opsd`` algorithm scores each sampled branch with the live policy after a hint block and
ships it as ``ref_logprobs``, but routes the tokens to ``ref_kl`` with no advantage. :class:`ComposerSDPOAlgorithm`
does the same scoring and keeps GRPO's advantages (``action_loss_type = "rl"``), so ``composer_loss`` gets both.
The hint is ``trace.info[hint_key]``, a verifiers environment's feedback on the trace (``hint_env``) or a user
``hint_fn(episode, trace)``; a trace without one gets no ``ref_logprobs`` (channel 1 only). Without ``prime_rl``
the hooks run on structurally identical local stand-ins. :func:`install` registers ``"composer_sdpo"`` in
PRIME-RL's ``ALGORITHM_CLASSES``; selecting it from a TOML also needs it in PRIME-RL's closed ``AlgoConfig`` union.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from composer_core.sdpo.context import (
    TeacherContextOptions,
    TeacherContexts,
    build_teacher_contexts,
    cap_reprompt,
)
from composer_core.traces.hints import HintJob, hint_jobs, load_hint_fn

__all__ = [
    "HAS_PRIME_RL_ORCHESTRATOR",
    "ComposerSDPOAlgorithm",
    "ComposerSDPOSettings",
    "env_hint_fn",
    "install",
    "trace_hint_jobs",
]

ALGO_TYPE = "composer_sdpo"

try:  # pragma: no cover - exercised only inside a PRIME-RL orchestrator environment
    from prime_rl.orchestrator.algo.base import iter_trainable_traces  # type: ignore[import-not-found, unused-ignore]
    from prime_rl.orchestrator.algo.grpo import GRPOAlgorithm as _Base  # type: ignore[import-not-found, unused-ignore]
    from prime_rl.orchestrator.algo.routing import (  # type: ignore[import-not-found, unused-ignore]
        assign_reference_logprobs,
    )
    from prime_rl.orchestrator.trajectories import (  # type: ignore[import-not-found, unused-ignore]
        iter_trainable_branches,
    )

    HAS_PRIME_RL_ORCHESTRATOR = True
except ImportError:
    HAS_PRIME_RL_ORCHESTRATOR = False

    def iter_trainable_traces(episodes: Sequence[Any]) -> Iterator[tuple[Any, Any]]:  # type: ignore[misc]
        """Mirror of PRIME-RL's: clean trainable traces that contain sampled tokens."""
        for episode in episodes:
            for trace in episode.traces:
                if trace.has_error or not trace.agent.trainable:
                    continue
                if any(any(node.mask) for node in trace.nodes):
                    yield episode, trace

    def iter_trainable_branches(trace: Any) -> Iterator[tuple[Any, Any]]:  # type: ignore[misc]
        """Mirror: each branch of the trace (``trace.branches``) with a sampled token."""
        for branch in trace.branches:
            if any(any(node.mask) for node in branch.nodes):
                yield branch, None

    def assign_reference_logprobs(branch: Any, values: list[float]) -> None:  # type: ignore[misc]
        """Mirror of PRIME-RL's: project branch-aligned log-probs onto the sampled nodes."""
        if len(values) != len(branch.token_ids):
            raise ValueError(
                f"reference logprobs must align with branch tokens: got {len(values)}, expected {len(branch.token_ids)}"
            )
        offset = 0
        for node in branch.nodes:
            end = offset + len(node.token_ids)
            if any(node.mask) and node.reference_logprobs is None:
                node.reference_logprobs = [
                    float(v) for v, sampled in zip(values[offset:end], node.mask, strict=True) if sampled
                ]
            offset = end

    class _Base:  # type: ignore[no-redef]
        """Mirror of PRIME-RL's ``GRPOAlgorithm`` hooks (advantage = reward − group mean)."""

        def __init__(self, config: Any, policy_pool: Any) -> None:
            self.policy_pool = policy_pool

        async def score_group(self, episodes: list[Any]) -> None:
            traces = [trace for _, trace in iter_trainable_traces(episodes)]
            if not traces:
                return
            mean = sum(t.reward for t in traces) / len(traces)
            for trace in traces:
                for node in (n for n in trace.nodes if any(n.mask)):
                    node.advantages = [float(trace.reward - mean)] * sum(node.mask)


HintFn = Callable[[Any, Any], "str | None"]


@dataclass(frozen=True)
class ComposerSDPOSettings(TeacherContextOptions):
    """Options of :class:`ComposerSDPOAlgorithm` (the ``[...algo]`` table keys of ComposerSDPOAlgoConfig): the
    teacher-context options of composer_core's :class:`TeacherContextOptions` (inherited), and

    hint_key: key of ``trace.info`` holding the environment's feedback (the hint); default ``feedback``.
    hint_fn: optional import path ``module.function`` of ``hint_fn(episode, trace) -> str | None``; takes
        precedence over ``hint_key``.
    hint_env: optional environment spec (``verifiers:<module>``): the hint is that environment's feedback on the
        trace (:func:`env_hint_fn`); takes precedence over ``hint_key``, exclusive with ``hint_fn``.
    hint_role: role of the hint message (``system`` like ``opsd``, or ``user``).
    template: ``str.format`` template of the hint message with ``{hint}``.
    sdpo_teacher: only ``live`` (the inference server's policy scores the hinted context).
    seed: seeds ``demo_pick="random"``; each group draws from ``seed`` and a CRC of its own prompts and
        completions, so a rerun picks the same demonstrations whatever order the groups are scored in.

    ``max_reprompt_len`` caps the teacher's prompt (the rendered reprompt, or the hint block and the trace's
    prompt) to its last that many tokens, as TRL's SDPOTrainer does.
    """

    hint_key: str = "feedback"
    hint_fn: str | None = None
    hint_env: str | None = None
    hint_role: str = "system"
    template: str = "{hint}"
    sdpo_teacher: str = "live"
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sdpo_teacher != "live":
            raise ValueError(
                f"composer_sdpo: sdpo_teacher={self.sdpo_teacher!r} is not available here: the orchestrator scores "
                "with the inference server's live policy; set sdpo_teacher='live' (ema/base need a second server)."
            )
        if self.hint_role not in ("system", "user"):
            raise ValueError(f"composer_sdpo: hint_role={self.hint_role!r} must be 'system' or 'user'.")
        if self.hint_fn and self.hint_env:
            raise ValueError(
                "composer_sdpo: set hint_fn or hint_env, not both (each is a whole hint source)."
            )
        if "{hint}" not in self.template:
            raise ValueError(f"composer_sdpo: template={self.template!r} must contain '{{hint}}'.")

    @classmethod
    def from_config(cls, config: Any) -> ComposerSDPOSettings:
        """The settings from a config's attributes (or a dict's keys); what it lacks keeps its default."""

        names = [f.name for f in fields(cls)]
        if isinstance(config, dict):
            return cls(**{k: config[k] for k in names if k in config})
        return cls(**{k: getattr(config, k) for k in names if hasattr(config, k)})


def env_hint_fn(spec: str) -> HintFn:
    """``hint_fn(episode, trace)``: the feedback of environment ``spec`` (``verifiers:<module>``) on the trace.

    PRIME-RL's environments are verifiers environments: the trace is PRIME-RL's ``vf.Trace``, re-scored (a copy)
    by the environment's own rewards through composer's adapter, whose feedback text is the hint.
    """
    from composer_core.envs import load_env

    env = load_env(spec)
    feedback = getattr(env, "trace_feedback", None)
    if not callable(feedback):
        raise ValueError(
            f"composer_sdpo: hint_env={spec!r} ({env.name}) cannot read a PRIME-RL trace; use verifiers:<module>."
        )
    return lambda episode, trace: feedback(trace)  # type: ignore[no-any-return]


def trace_hint_jobs(
    settings: ComposerSDPOSettings, hint_fn: HintFn | None, episode: Any, traces: Sequence[Any]
) -> list[HintJob[Any]]:
    """The traces that get a hint (``composer_core.traces.hints.hint_jobs``), hint formatted by ``template``."""
    return hint_jobs(
        traces, lambda trace: _raw_hint(settings, hint_fn, episode, trace),
        option="composer_sdpo: the hint", template=settings.template,
    )  # fmt: skip


def _raw_hint(settings: ComposerSDPOSettings, hint_fn: HintFn | None, episode: Any, trace: Any) -> object:
    """The hint source's answer for one trace: ``hint_fn``'s, else ``trace.info[hint_key]``."""
    if hint_fn is not None:
        return hint_fn(episode, trace)
    return (getattr(trace, "info", None) or {}).get(settings.hint_key)


class ComposerSDPOAlgorithm(_Base):  # type: ignore[misc, valid-type]
    """GRPO advantages + hinted self-scoring (``ref_logprobs``), both consumed by the ``rl`` loss."""

    action_loss_type = "rl"

    def __init__(self, config: Any, policy_pool: Any) -> None:
        super().__init__(config, policy_pool)
        self.settings = ComposerSDPOSettings.from_config(config)
        self.hint_fn: HintFn | None = None
        if self.settings.hint_fn:
            self.hint_fn = load_hint_fn(self.settings.hint_fn, option="composer_sdpo: hint_fn")
        elif self.settings.hint_env:
            self.hint_fn = env_hint_fn(self.settings.hint_env)
        self.renderer: Any = getattr(config, "renderer_instance", None)
        self._renderer_config = getattr(config, "renderer", None)

    async def setup(self) -> None:
        """Build the hint-block renderer from the live policy's tokenizer (as ``opsd`` does)."""
        if self.renderer is None:
            from renderers.base import create_renderer, load_tokenizer  # type: ignore[import-not-found]

            self.renderer = create_renderer(
                load_tokenizer(self.policy_pool.model_name), self._renderer_config
            )

    def decode(self, ids: Sequence[int]) -> str:
        tokenizer = getattr(self.renderer, "tokenizer", None)
        if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
            raise RuntimeError(
                "composer_sdpo: sdpo_teacher_context from the group needs renderer.tokenizer.decode "
                "(to read each trace's prompt and completion text)."
            )
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    def teacher_contexts(self, episodes: Sequence[Any]) -> tuple[list[Any], TeacherContexts]:
        """The group's traces and their teacher contexts (core's ``build_teacher_contexts``, one group).

        A trace's prompt is its ``prompt`` messages (a chat prompt) or else the text of its leading unsampled nodes,
        its completion the text of its sampled tokens; the feedback is the hint source's raw answer (``hint_fn`` /
        ``trace.info[hint_key]``)."""
        pairs = list(iter_trainable_traces(episodes))
        if not pairs:
            return [], TeacherContexts([], [], [])
        prompts: list[Any] = []
        completions: list[str] = []
        feedback: list[str | None] = []
        for episode, trace in pairs:
            messages = getattr(trace, "prompt", None)  # a chat prompt's messages, where the trace keeps them
            if isinstance(messages, list) and messages:
                prompts.append(messages)
            else:
                prompts.append(
                    self.decode([t for n in trace.nodes[: _prompt_prefix(trace)] for t in n.token_ids])
                )
            completions.append(
                self.decode([t for n in trace.nodes for t, m in zip(n.token_ids, n.mask, strict=True) if m])
            )
            raw = _raw_hint(self.settings, self.hint_fn, episode, trace)
            if raw is not None and not isinstance(raw, str):
                raise ValueError(
                    f"composer_sdpo: the feedback answered {type(raw).__name__}; return a string or None."
                )
            feedback.append(raw)
        traces = [trace for _, trace in pairs]
        group_seed = zlib.crc32(repr((self.settings.seed, prompts, completions)).encode())
        built = build_teacher_contexts(
            prompts, completions, [float(t.reward) for t in traces], len(traces), self.settings,
            feedback=feedback if self.settings.uses_feedback else None, seed=group_seed,
        )  # fmt: skip
        return traces, built

    async def score_group(self, episodes: list[Any]) -> None:
        await super().score_group(episodes)
        if not self.settings.from_group:
            return
        if self.renderer is None:
            raise RuntimeError("composer_sdpo: setup() must run before score_group (no renderer).")
        traces, built = self.teacher_contexts(episodes)
        for trace, context, keep in zip(traces, built.contexts, built.mask, strict=True):
            if keep:
                messages = context if isinstance(context, list) else [{"role": "user", "content": context}]
                block = [int(i) for i in self.renderer.render_ids(messages, add_generation_prompt=True)]
                prefix = sum(len(n.token_ids) for n in trace.nodes[: _prompt_prefix(trace)])
                await self._score_branches(trace, block, prefix)

    async def score_episode(self, episode: Any) -> None:
        if self.renderer is None:
            raise RuntimeError("composer_sdpo: setup() must run before score_episode (no renderer).")
        if self.settings.from_group:
            return  # the teacher context needs the whole group: score_group
        traces = [trace for _, trace in iter_trainable_traces([episode])]
        for job in trace_hint_jobs(self.settings, self.hint_fn, episode, traces):
            hint = [{"role": self.settings.hint_role, "content": job.hint}]
            block = self.renderer.render_ids(hint, add_generation_prompt=False)
            await self._score_branches(job.item, [int(i) for i in block])

    async def _score_branches(self, trace: Any, block: list[int], prefix: int = 0) -> None:
        """Score each trainable branch of ``trace`` with the live policy after ``block`` (which replaces the
        branch's first ``prefix`` tokens; with ``prefix=0`` the hint block goes before the prompt) and ship the
        log-probs as its ``ref_logprobs`` (0 on the prompt). The teacher's prompt, ``block`` and what is left of
        the trace's prompt, keeps its last ``max_reprompt_len`` tokens."""
        branches = [branch for branch, _ in iter_trainable_branches(trace)]
        prompt = sum(len(n.token_ids) for n in trace.nodes[: _prompt_prefix(trace)])
        heads = [
            cap_reprompt(block + list(b.token_ids)[prefix:prompt], self.settings.max_reprompt_len)
            for b in branches
        ]
        scores = await asyncio.gather(
            *(
                self.policy_pool.score(h + list(b.token_ids)[prompt:])
                for h, b in zip(heads, branches, strict=True)
            )
        )
        for branch, head, full in zip(branches, heads, scores, strict=True):
            assign_reference_logprobs(branch, [0.0] * prompt + list(full)[len(head) :])


def _prompt_prefix(trace: Any) -> int:
    """Number of leading nodes without a sampled token (the prompt)."""
    for i, node in enumerate(trace.nodes):
        if any(node.mask):
            return i
    return len(trace.nodes)


def install() -> type:
    """Register :class:`ComposerSDPOAlgorithm` as ``"composer_sdpo"`` in PRIME-RL's ``ALGORITHM_CLASSES``."""
    from prime_rl.orchestrator import algo  # type: ignore[import-not-found]

    algo.ALGORITHM_CLASSES[ALGO_TYPE] = ComposerSDPOAlgorithm
    return ComposerSDPOAlgorithm
