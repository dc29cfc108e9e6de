"""Benchmark: where one training step's time goes on the real model, per arm, against each arm's floor (issue 63).

SmolLM2-135M-Instruct on the addition task, the arms of ``compare_smollm2.py`` (same trainer settings, the measured
completion budget of ``results/addition_budget.json``), float32 and bf16 (bf16 only where the CPU has
AVX512-BF16). Each arm trains in its own process (its peak RSS is that process's) with the trainer's methods
wrapped by a timing context (here only, nothing in ``src``); every phase records its exclusive seconds and the
tokens it processed (rows x padded width, and real tokens). Phases: generation, scoring and batch building,
teacher context building, pair building, old/ref log-prob forwards, the policy forward (with the chosen rows of
on-policy pairs riding in it), SFT forward, teacher forward, loss math, backward, per-channel grad-norm logging,
grad clipping, optimizer, EMA update, logging; ``generation`` is split into the decode loop (``generation
(decode)``) and the rest (tokenising, text, metrics); ``other`` is the step minus them all. Median over the steps
after the warm-up step.

Floor of an arm = the plain GRPO step **on the arm's own completions** + exactly the extra work that arm's step
needs, taken from each of the arm's steps and each part timed alone (:func:`_bare`): its sequences with gradient (SFT
rows, the chosen side of on-policy pairs) through the trainer's own policy forward and a backward; the teacher's
hinted contexts without gradient, with the LM head over the real completion positions; for SDPO, the student's
full-vocabulary logits over the distilled tokens, forward and backward through the LM head. The floor runs in a
process of its own (its peak RSS is the floor's) that trains plain GRPO on the arm's recorded completions, step for
step, so both score, forward and update the same tokens (each arm's policy writes different completions after step
1, and their lengths move a step by seconds); it still decodes (and drops the result), so it carries the same
allocator and cache state into the step, and its decode time is swapped for the arm's. Its extra work of step i is
timed right after step i (and left out of the step).

Three processes per arm: the arm alone records its completions and each step's extra sequences (its seconds per
step, phases and peak RSS are the table's); then the arm **replaying** that recording and its floor run **at the
same time**, on half the threads each: on a shared host, load moves two processes run side by side alike, while
runs minutes apart differed by up to 15% (grpo against its own replay, run one after the other, read 0.915 to
1.145). Per step: ``floor_i = GRPO step_i (replayed) - its decode_i + replay decode_i + extras_i``; ``floor =
median(floor_i)``; ``ratio = median replay step / floor``; the target is <= 1.1.
The grpo arm gets a floor too (GRPO replaying its own completions): its ratio is the bench's own noise. ``trl
sdpo`` is TRL's own SDPOTrainer, timed by its own methods and reported beside the bound arms.

Writes ``bench_profile.json`` to ``$COMPOSER_BENCH_OUT`` (default ./bench-results); ``--small`` is CI's check that
it works (a tiny random model with SmolLM2's tokenizer, 2 steps, grpo, composer and trl sdpo, float32).

    python packages/composer-trl/bench/bench_profile.py [--steps 5] [--threads 2] [--dtype both] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compare import cpu_has_bf16, finish, machine, start, write_json
from compare_smollm2 import ARMS, COMMON, MODEL, _model_dir, _trainer, budget, task_rows

NORMS = "composer + log_channel_grad_norms"
_OFF = {"log_channel_grad_norms": False}
_COMPOSER = next(a for a in ARMS if a.name == "composer")
PROFILED = (
    *(replace(a, overrides={**_OFF, **a.overrides}) if a.kind == "composer" else a for a in ARMS),
    replace(_COMPOSER, name=NORMS, overrides={**_COMPOSER.overrides, "log_channel_grad_norms": True}),
)
"""The comparison's arms as a user runs them (composer's options at their defaults: no per-channel gradient norms,
which the comparison logs as curves), plus composer with the norms (the diagnostic's opt-in cost: one extra backward
per channel at each logging step, every step here: ``logging_steps=1``)."""
DEFAULT_ARMS = ("grpo", "sdpo (success)", "sdpo (success + feedback)", "grpo+sft", "grpo+replay", "composer",
                NORMS, "trl sdpo")  # fmt: skip
SMALL: dict[str, Any] = {"steps": 2, "arms": ("grpo", "composer", "trl sdpo"), "dtypes": ("float32",),
                         "trainer": {"per_device_train_batch_size": 4, "num_generations": 2,
                                     "max_completion_length": 8}}  # fmt: skip
TARGET = 1.1
T = TypeVar("T")
EXTRA_REPEATS = 2
CALLERS = {
    "_compute_loss": "policy forward",
    "_fill_sdpo": "teacher forward (sampled)",
    "_pair_logps": "pair forward",
    "_generate_and_score_completions": "old/ref log-prob forward",
}
"""``_get_per_token_logps_and_entropies``: the phase of each caller."""


# ------------------------------------------------------------------------------------------------ timing


class Profile:
    """Exclusive seconds and tokens per phase per step (a phase nested in another is subtracted from it)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, list[float]]] = []
        self.starts: list[float] = []
        self.stack: list[list[float]] = []
        self.excluded: list[float] = []  # seconds of each step that are not the step's (the floor's extras)
        self.paused = False

    @contextmanager
    def phase(self, name: str, rows: int = 0, width: int = 0, real: int = 0) -> Any:
        if self.paused:
            yield
            return
        self.stack.append([0.0])
        start = time.perf_counter()
        try:
            yield
        finally:
            total = time.perf_counter() - start
            child = self.stack.pop()[0]
            if self.stack:
                self.stack[-1][0] += total
            if self.steps:
                cell = self.steps[-1].setdefault(name, [0.0, 0, 0, 0])
                cell[0] += total - child
                cell[1] += 1
                cell[2] += rows * width
                cell[3] += real

    def wrap(self, obj: Any, attr: str, name: Any = None, tokens: Any = None) -> None:
        """Replace ``obj.attr`` by a timed call (``name``: the phase, ``name(args, kwargs)``, or by caller;
        ``tokens(args, kwargs)``)."""
        fn = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            phase = name(args, kwargs) if callable(name) else name
            phase = phase or CALLERS.get(sys._getframe(1).f_code.co_name, f"forward ({attr})")
            rows, width, real = tokens(args, kwargs) if tokens is not None else (0, 0, 0)
            with self.phase(phase, rows, width, real):
                return fn(*args, **kwargs)

        setattr(obj, attr, timed)


def _ids_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, int]:
    ids, mask = args[1], args[2]
    return ids.size(0), ids.size(1), int(mask.sum())


def _teacher_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, int]:
    inputs = args[2]
    rows = inputs["composer_has_hint"].nonzero().squeeze(-1)
    width = inputs["composer_hint_ids"].size(1) + inputs["completion_ids"].size(1)
    real = inputs["composer_hint_mask"][rows].sum() + inputs["completion_mask"][rows].sum()
    return rows.numel(), width, int(real)


def _sft_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, int]:
    ids = args[1]["sft_ids"]
    return ids.size(0), ids.size(1), int(args[1]["sft_attn"].sum())


_FORWARD_LOGITS = ("model", "input_ids", "attention_mask")
"""``SDPOTrainer._forward_logits``' first parameters (passed by keyword or by position)."""


def _forward_logits_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**dict(zip(_FORWARD_LOGITS, args, strict=False)), **kwargs}


def _trl_sdpo_forward_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int, int]:
    a = _forward_logits_args(args, kwargs)
    return a["input_ids"].size(0), a["input_ids"].size(1), int(a["attention_mask"].sum())


def instrument(trainer: Any, prof: Profile, kind: str, captured: list[Any]) -> None:
    """Wrap the trainer's phases (this process only) and keep every micro-batch's inputs in ``captured`` as
    ``(step index, inputs)``."""
    import composer_trl.trainer as ct
    from transformers import TrainerCallback

    p = prof
    if kind == "trl_sdpo":
        _instrument_trl_sdpo(trainer, p, captured)
        trainer.add_callback(_steps_callback(p, TrainerCallback))
        return
    p.wrap(trainer, "_generate_and_score_completions", "scoring + batch building")
    p.wrap(trainer, "_generate", "generation")
    p.wrap(trainer, "_generate_single_turn", "generation (decode)")
    p.wrap(trainer, "_get_per_token_logps_and_entropies", None, _ids_tokens)
    p.wrap(trainer.accelerator, "backward", "backward")
    p.wrap(trainer.accelerator, "clip_grad_norm_", "grad clip")
    p.wrap(trainer, "log", "logging (trainer.log)")
    p.wrap(trainer, "_compute_loss", "loss math + metrics")
    if kind == "sft":
        p.wrap(trainer, "compute_loss", "SFT forward + NLL", _sft_tokens)
    if kind == "composer":
        p.wrap(trainer, "_fill_sdpo", "teacher forward", _teacher_tokens)
        p.wrap(trainer, "_build_group_contexts", "teacher context building")
        p.wrap(trainer, "_build_hints", "teacher context building")
        p.wrap(trainer, "_build_pairs", "pair building")
        p.wrap(trainer._grad_norms, "add", "grad-norm logging")
        p.wrap(trainer._grad_norms, "log", "grad-norm logging")
        for cb in trainer.callback_handler.callbacks:
            if type(cb).__name__ == "_SDPOTeacherCallback":
                p.wrap(cb, "on_step_end", "EMA teacher update")
        original = ct.composer_trl_loss
        ct.composer_trl_loss = lambda *a, **k: _timed(p, "composer loss (core)", original, *a, **k)
    inner = trainer._compute_loss

    def keep(model: Any, inputs: dict[str, Any]) -> Any:
        captured.append(_captured(p, inputs))
        return inner(model, inputs)

    trainer._compute_loss = keep
    trainer.add_callback(_steps_callback(p, TrainerCallback))


def _captured(p: Profile, inputs: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return len(p.steps) - 1, {k: v.detach().cpu() for k, v in inputs.items() if hasattr(v, "detach")}


def _instrument_trl_sdpo(trainer: Any, p: Profile, captured: list[Any]) -> None:
    """TRL's SDPOTrainer by its own methods: one full-logits forward of the student (its loss is the distillation
    alone at ``distillation_weight=1``) and one of the teacher over every row's reprompted context."""
    p.wrap(trainer, "_prepare_training_batch", "scoring + batch building")
    p.wrap(trainer, "_generate", "generation")
    p.wrap(trainer, "_generate_transformers", "generation (decode)")
    p.wrap(trainer.teacher_context_builder, "build", "teacher context building")

    def which(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        teacher = _forward_logits_args(args, kwargs)["model"] is trainer.teacher_model
        return "teacher forward" if teacher else "policy forward"

    p.wrap(trainer, "_forward_logits", which, _trl_sdpo_forward_tokens)
    p.wrap(trainer.accelerator, "backward", "backward")
    p.wrap(trainer.accelerator, "clip_grad_norm_", "grad clip")
    p.wrap(trainer, "log", "logging (trainer.log)")
    p.wrap(trainer, "_compute_self_distillation_loss", "loss math + metrics")
    for cb in trainer.callback_handler.callbacks:
        if type(cb).__name__ in ("SyncTeacherModelCallback", "PEFTAdapterEMACallback"):
            p.wrap(cb, "on_step_end", "EMA teacher update")
    inner = trainer.compute_loss

    def keep(model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> Any:
        captured.append(_captured(p, inputs))
        return inner(model, inputs, *a, **k)

    trainer.compute_loss = keep


def _steps_callback(p: Profile, base: type) -> Any:
    """A callback that opens a step in ``p`` at each step's start and times the optimizer step."""

    class Steps(base):  # type: ignore[misc, valid-type]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            p.starts.append(time.perf_counter())
            p.steps.append({})
            p.excluded.append(0.0)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t = time.perf_counter()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            p.steps[-1].setdefault("optimizer", [0.0, 0, 0, 0])[0] += time.perf_counter() - self.t
            p.steps[-1]["optimizer"][1] += 1

    return Steps()


def _timed(p: Profile, name: str, fn: Any, *a: Any, **k: Any) -> Any:
    with p.phase(name):
        return fn(*a, **k)


# ------------------------------------------------------------------------------------------------ children


def _load(spec: dict[str, Any]) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    torch.set_num_threads(int(spec["threads"]))
    tok = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not spec["small"]:
        return AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32), tok
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    path = Path(spec["work_dir"]) / "model"  # a path of its own: TRL's SDPOTrainer builds its teacher from it
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path), tok


def _extras(kind: str, arm: Any, inp: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The extra work of an arm's step: ``{name: {ids, mask, keep, grad}}`` (keep: scored positions) per extra
    sequence set, and for SDPO ``{tokens}``: the distilled completion tokens whose full-vocabulary student logits the
    loss needs (TRL's fused LM head forms only the sampled token's log-prob)."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    if kind == "sft":
        ids, attn, target = inp["sft_ids"], inp["sft_attn"], inp["sft_target"]
        first = int(target.float().argmax(-1).min())  # the earliest answer position
        out["SFT sequences (fwd+bwd)"] = {"ids": ids, "mask": attn, "keep": ids.size(1) - first, "grad": True}
    if kind == "trl_sdpo" and bool(inp["self_distillation_mask"].any()):
        # the distilled rows only (TRL forwards every row's teacher context, a row without a teacher at zero
        # weight); its default sampled-token form needs the student's log-prob of the sampled token alone, which the
        # GRPO step's policy forward already computes: no student head pass
        rows = inp["self_distillation_mask"].nonzero().squeeze(-1)
        ids, mask = inp["teacher_input_ids"][rows], inp["teacher_attention_mask"][rows]
        _sdpo_extras(out, ids, mask, inp["completion_mask"][rows], student_head=False)
    if kind != "composer":
        return out
    if "composer_has_hint" in inp and bool(inp["composer_has_hint"].any()):
        rows = inp["composer_has_hint"].nonzero().squeeze(-1)
        ids = torch.cat([inp["composer_hint_ids"][rows], inp["completion_ids"][rows]], 1)
        mask = torch.cat([inp["composer_hint_mask"][rows], inp["completion_mask"][rows]], 1)
        _sdpo_extras(out, ids, mask, inp["completion_mask"][rows])
    if "composer_has_pair" in inp and bool(inp["composer_has_pair"].any()):
        rows = inp["composer_has_pair"].nonzero().squeeze(-1)
        on_policy = arm.overrides.get("replay_pairs") == "on_policy"
        sides = ("chosen",) if on_policy else ("chosen", "rejected")
        pair = torch.cat([inp[f"composer_{s}_ids"][rows] for s in sides])
        pattn = torch.cat([inp[f"composer_{s}_attn"][rows] for s in sides])
        ids = torch.cat([torch.cat([inp["prompt_ids"][rows]] * len(sides)), pair], 1)
        mask = torch.cat([torch.cat([inp["prompt_mask"][rows]] * len(sides)), pattn], 1)
        name = "chosen side of pairs (fwd+bwd)" if on_policy else "pairs (fwd+bwd)"
        out[name] = {"ids": ids, "mask": mask, "keep": pair.size(1), "grad": True}
    return out


def _sdpo_extras(
    out: dict[str, dict[str, Any]], ids: Any, mask: Any, completion_mask: Any, student_head: bool = True
) -> None:
    """SDPO's extra work: the teacher's contexts (prompt ⊕ hint ⊕ completion) without gradient, its logits at the
    completion positions, and (a form over whole distributions) the student's full-vocabulary logits over the real
    completion tokens."""
    keep = completion_mask.size(1)
    out["teacher hinted contexts (no-grad fwd)"] = {"ids": ids, "mask": mask, "keep": keep, "grad": False}
    if student_head:
        tokens = int(completion_mask.sum())
        out["student LM head over the distilled tokens (fwd+bwd)"] = {"tokens": tokens, "ids": ids[:, -keep:]}


def _bare(trainer: Any, x: dict[str, Any]) -> None:
    """The extra work ``x`` alone, as the plain GRPO step would do it: sequences with gradient through the trainer's
    own policy forward (TRL's fused LM head over the scored positions, entropies as the policy forward computes
    them) and a backward of their summed log-probs; a teacher's sequences without gradient, the backbone and the LM
    head over the real completion positions; the full-vocabulary student logits of ``tokens`` positions, forward
    and backward through the LM head."""
    import torch

    model = trainer.model
    head = model.get_output_embeddings()
    if "tokens" in x:
        hidden = torch.randn(int(x["tokens"]), head.in_features, requires_grad=True)
        torch.logsumexp(head(hidden).float(), -1).sum().backward()
    elif x["grad"]:
        k = int(x["keep"])
        logps = trainer._get_per_token_logps_and_entropies(
            model, x["ids"], x["mask"], k, compute_entropy=True
        )[0]
        (logps * x["mask"][:, -k:]).sum().backward()
    else:
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        k = int(x["keep"])
        with torch.no_grad():
            hidden = base(input_ids=x["ids"], attention_mask=x["mask"], use_cache=False).last_hidden_state
            head(hidden[:, -k - 1 : -1][x["mask"][:, -k:].bool()])
    model.zero_grad(set_to_none=True)


def _record_or_replay(trainer: Any, spec: dict[str, Any], kind: str) -> list[Any]:
    """An arm records what each decode call got and returned; its replay and its floor decode too (so every process
    carries what a decode leaves behind: allocator and caches) but return the arm's recording, in order, so they
    score, forward and update the arm's tokens. The list of ``(prompt ids, (completion ids, logprobs))`` per call,
    in the form GRPO's ``_generate_single_turn`` returns (TRL's SDPOTrainer decodes in ``_generate_transformers``:
    the same prompt ids in, the completion ids out). A replay whose prompts differ from the arm's stops the bench."""
    import torch

    out: list[Any] = []
    replay = spec["role"] != "arm"
    recorded = iter(torch.load(spec["generations"]) if replay else ())
    attr = "_generate_transformers" if kind == "trl_sdpo" else "_generate_single_turn"
    decode = getattr(trainer, attr)

    def record(prompt_ids: list[list[int]], *a: Any, **k: Any) -> Any:
        own = decode(prompt_ids, *a, **k)
        prompts = [list(p) for p in prompt_ids]
        out.append(next(recorded) if replay else (prompts, (own[1], None) if kind == "trl_sdpo" else own))
        if out[-1][0] != prompts:
            raise SystemExit(
                f"bench_profile: the {spec['role']}'s decode call {len(out)} got other prompts than its arm's"
            )
        if not replay:
            return own
        return (prompt_ids, out[-1][1][0]) if kind == "trl_sdpo" else out[-1][1]

    setattr(trainer, attr, record)
    return out


def run_child(spec_path: str) -> int:
    """One process of an arm (``spec["role"]``: ``"arm"`` records, ``"replay"`` replays the recording) or its
    ``"floor"``: writes ``spec["result"]``."""
    import torch
    from transformers import TrainerCallback

    spec = json.loads(Path(spec_path).read_text())
    model, tok = _load(spec)
    arm = next(a for a in PROFILED if a.name == spec["arm"])
    run_arm = arm if spec["role"] != "floor" else next(a for a in PROFILED if a.name == "grpo")
    need = int(spec["trainer"]["per_device_train_batch_size"]) // int(spec["trainer"]["num_generations"])
    train, _, _ = task_rows(0, need * (spec["steps"] + 1))
    trainer = _trainer(spec, run_arm, model, tok, train)
    generations = _record_or_replay(trainer, spec, run_arm.kind)
    prof, captured = Profile(), []
    instrument(trainer, prof, run_arm.kind, captured)
    extras = _StepExtras(trainer, spec, prof, torch.load(spec["extras"]) if spec["role"] == "floor" else [])
    trainer.add_callback(extras.callback(TrainerCallback))
    start = time.perf_counter()
    trainer.train()
    prof.starts.append(time.perf_counter())
    result: dict[str, Any] = {"train_seconds": prof.starts[-1] - start}
    result["step_seconds"] = [b - a - x for a, b, x in zip(prof.starts, prof.starts[1:], prof.excluded)]
    result["phases"] = prof.steps
    result["decode_calls"] = len(generations)
    # per call, as the step got them
    result["completion_tokens"] = [sum(map(len, g[1][0])) for g in generations]
    if spec["role"] == "arm":
        torch.save([(i, _extras(arm.kind, arm, inp)) for i, inp in captured], spec["extras"])
        torch.save(generations, spec["generations"])
    if spec["role"] == "floor":
        result["extra_seconds"], result["extras"] = extras.per_step, extras.summary()
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


class _StepExtras:
    """The floor's extra work of each measured step (the arm's, from its recording), timed alone right after that
    step, so it shares the step's machine conditions, and left out of the step's time and phases. Each part: the
    median of ``EXTRA_REPEATS`` runs, after one warm-up run the first time the part is timed."""

    def __init__(self, trainer: Any, spec: dict[str, Any], prof: Profile, per_batch: list[Any]) -> None:
        import torch

        self.trainer, self.prof, self.per_batch = trainer, prof, per_batch
        self.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(spec["bf16"]))
        self.per_step = [0.0] * int(spec["steps"])
        self.parts: dict[str, Any] = {}

    def callback(self, base: type) -> Any:
        outer = self

        class Extras(base):  # type: ignore[misc, valid-type]
            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                outer.time_step(len(outer.prof.steps) - 1)

        return Extras()

    def time_step(self, step: int) -> None:
        if step not in _measured(range(len(self.per_step))):
            return
        start, self.prof.paused = time.perf_counter(), True
        for extras in (x for i, x in self.per_batch if i == step):
            for name, x in extras.items():
                self._time(step, name, x)
        self.prof.paused = False
        self.prof.excluded[step] += time.perf_counter() - start

    def _time(self, step: int, name: str, x: dict[str, Any]) -> None:
        secs = []
        for _ in range(EXTRA_REPEATS + (name not in self.parts)):
            t = time.perf_counter()
            with self.autocast():
                _bare(self.trainer, x)
            secs.append(time.perf_counter() - t)
        seconds = statistics.median(secs[-EXTRA_REPEATS:])
        self.per_step[step] += seconds
        part = self.parts.setdefault(name, {"seconds": [0.0] * len(self.per_step)})
        part["seconds"][step] += seconds
        part.update(rows=x["ids"].size(0), width=x["ids"].size(1),
                    real_tokens=int(x["tokens"] if "tokens" in x else x["mask"].sum()),
                    distinct_rows=len({tuple(r.tolist()) for r in x["ids"]}))  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """Per part: its seconds per step, their median over the measured steps (0 where a step had none), the
        median over the steps that had it, and the last such step's rows, width, real tokens and distinct rows."""
        for part in self.parts.values():
            present = [x for x in _measured(part["seconds"]) if x > 0]
            part["median"] = statistics.median(_measured(part["seconds"]))
            part["steps_with"], part["median_with"] = len(present), statistics.median(present)
        return self.parts


# ------------------------------------------------------------------------------------------------ the parent


def _phase_medians(phases: list[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    measured = _measured(phases)
    names = sorted({n for s in measured for n in s})
    return {
        n: {
            "seconds": statistics.median(s.get(n, [0.0])[0] for s in measured),
            "calls": statistics.median(s.get(n, [0, 0])[1] for s in measured),
            "padded_tokens": statistics.median(s.get(n, [0, 0, 0])[2] for s in measured),
            "real_tokens": statistics.median(s.get(n, [0, 0, 0, 0])[3] for s in measured),
        }
        for n in names
    }


def _spawn(specs: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """Run a child per spec, all at the same time; their results (with peak RSS) in order."""
    started = []
    for spec in specs:
        name = f"{spec['role']}-{spec['arm']}-{spec['dtype']}".replace(" ", "_").replace("/", "_")
        spec = {**spec, "result": str(tmp / f"{name}.json"), "work_dir": str(tmp / name)}
        (tmp / f"{name}.spec.json").write_text(json.dumps(spec))
        started.append(
            (name, spec, start([__file__, "--child", str(tmp / f"{name}.spec.json")], tmp / f"{name}.log"))
        )
    done = [(name, spec, finish(proc)) for name, spec, proc in started]
    results = []
    for name, spec, (code, rss) in done:
        if code != 0:
            log = (tmp / f"{name}.log").read_text()[-3000:]
            raise SystemExit(f"bench_profile: {name} failed (exit {code}):\n{log}")
        result: dict[str, Any] = json.loads(Path(spec["result"]).read_text())
        result["peak_rss_mib"] = rss
        results.append(result)
    return results


def _summarise(r: dict[str, Any]) -> list[float]:
    """A run's median step and phase medians (``other``: the step minus its phases); its decode seconds per step."""
    r["median_step_seconds"] = statistics.median(_measured(r["step_seconds"]))
    decode = [s.get("generation (decode)", [0.0])[0] for s in r["phases"]]
    r["phase_medians"] = ph = _phase_medians(r.pop("phases"))
    rest = r["median_step_seconds"] - sum(v["seconds"] for v in ph.values())
    ph["other (trainer loop)"] = {"seconds": rest, "calls": 0, "padded_tokens": 0, "real_tokens": 0}
    return decode


def profile_dtype(base: dict[str, Any], arms: list[str], tmp: Path) -> dict[str, Any]:
    """Every arm at one dtype: a recording run alone (its seconds per step, phases and peak RSS at ``threads``),
    then the arm replaying that recording and its floor at the same time on half the threads each, so the ratio
    compares two processes under the same machine conditions (a shared host's load moves both alike)."""
    out: dict[str, Any] = {}
    half = max(1, int(base["threads"]) // 2)
    for name in arms:
        files = {
            k: str(tmp / f"{k}-{name}-{base['dtype']}.pt".replace(" ", "_"))
            for k in ("extras", "generations")
        }
        (r,) = _spawn([{**base, "role": "arm", "arm": name, **files}], tmp)
        _summarise(r)
        pair = [{**base, "threads": half, "role": role, "arm": name, **files} for role in ("replay", "floor")]
        rep, f = _spawn(pair, tmp)
        decode = _summarise(rep)
        own = [s.get("generation (decode)", [0.0])[0] for s in f["phases"]]  # swapped for the replay's
        steps = zip(f.pop("step_seconds"), own, decode, f["extra_seconds"], strict=True)
        f["floor_step_seconds"] = [g - o + d + e for g, o, d, e in steps]
        floor = statistics.median(_measured(f["floor_step_seconds"]))
        ratio = rep["median_step_seconds"] / floor
        out[name] = {"arm": r, "replay": rep, "floor_process": f, "floor_seconds": floor, "ratio": ratio,
                     "floor_rss_mib": f["peak_rss_mib"], "paired_threads": half}  # fmt: skip
        print(f"[bench_profile] {base['dtype']} {name}: {r['median_step_seconds']:.3f} s/step alone; paired "
              f"({half} thread(s) each): arm {rep['median_step_seconds']:.3f} s, floor {floor:.3f} s, ratio "
              f"{ratio:.3f}", flush=True)  # fmt: skip
    return out


def _measured(steps: list[T]) -> list[T]:
    """The steps after the warm-up step (all of them when there is only one)."""
    return steps[1:] or steps


def _rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for dtype, arms in results.items():
        for name, e in arms.items():
            ph = e["arm"]["phase_medians"]
            top = sorted(ph.items(), key=lambda kv: -kv[1]["seconds"])[:3]
            rows.append([dtype, name, round(e["arm"]["median_step_seconds"], 3),
                         round(e["replay"]["median_step_seconds"], 3), round(e["floor_seconds"], 3),
                         f"{e['ratio']:.3f}", round(e["arm"]["peak_rss_mib"]), round(e["floor_rss_mib"]),
                         ", ".join(f"{k} {v['seconds']:.2f}" for k, v in top)])  # fmt: skip
    return rows


def _note(results: dict[str, Any]) -> str:
    """Which tokens make each floor: the extra sequences of every arm's last step, with the median seconds of each
    part over the measured steps (the first dtype's run)."""
    parts = []
    for name, e in next(iter(results.values())).items():
        extras = (e["floor_process"] or {}).get("extras") or {}
        if name == NORMS:  # the same sequences as composer's
            continue
        parts += [
            f"{name}: {k} {v['rows']} × {v['width']} ({v['real_tokens']} real tokens, {v['distinct_rows']} distinct "
            f"rows; {v['median_with']:.2f} s in each of the {v['steps_with']} measured steps that had it)"
            for k, v in extras.items()
        ]
    return (
        "Extra sequences of each arm's last step that had them (floor = GRPO step on the arm's completions + each "
        "step's extra sequences alone; seconds: the median over the steps that had them): "
        + "; ".join(parts)
        + "."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5, help="training steps per arm (the first is the warm-up)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--dtype", choices=("both", "float32", "bf16"), default="both",
                   help="both: float32, and bf16 where the CPU has AVX512-BF16")  # fmt: skip
    p.add_argument(
        "--arms",
        nargs="+",
        default=list(DEFAULT_ARMS),
        choices=[a.name for a in PROFILED],
        help="arms of compare_smollm2.py (+ composer with the per-channel gradient norms)",
    )
    p.add_argument("--budget", type=int, help="completion tokens (default: results/addition_budget.json's)")
    p.add_argument("--small", action="store_true", help="tiny model, 2 steps, grpo and composer: CI's check")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.exit(run_child(args.child))
    dtypes = ["float32", "bf16"] if args.dtype == "both" else [args.dtype]
    dtypes = [d for d in dtypes if d == "float32" or cpu_has_bf16()]
    arms = list(args.arms)
    if args.small:
        args.budget = SMALL["trainer"]["max_completion_length"]
        args.steps, arms, dtypes = SMALL["steps"], list(SMALL["arms"]), list(SMALL["dtypes"])
    trainer = {
        **COMMON,
        "max_completion_length": args.budget or budget(),
        **(SMALL["trainer"] if args.small else {}),
    }
    if "grpo" not in arms:
        p.error("--arms: the floors need 'grpo' (the plain GRPO step)")
    base = {"model": _model_dir(MODEL), "small": args.small, "steps": args.steps, "threads": args.threads,
            "trainer": trainer, "seed": 0, "device": "cpu"}  # fmt: skip
    results: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            results[dtype] = profile_dtype({**base, "dtype": dtype, "bf16": dtype == "bf16"}, arms, Path(tmp))
    rows = _rows(results)
    data = {
        "model": "tiny random Llama (SmolLM2 tokenizer)" if args.small else MODEL,
        "small": args.small, "steps": args.steps, "trainer": trainer, "target_ratio": TARGET,
        "seconds": time.perf_counter() - started, "results": results,
        "machine": machine(args.threads),
        "readme": {
            "title": f"One training step by phase, {MODEL} on addition, {trainer['per_device_train_batch_size']} "
                     f"completions x {trainer['max_completion_length']} tokens, CPU {args.threads} threads "
                     f"(median of {args.steps - 1} steps after a warm-up; s/step and phases: the arm alone; "
                     f"step/floor: the arm replaying its completions and its floor at the same time, "
                     f"{max(1, args.threads // 2)} thread(s) each; floor = GRPO step on the arm's own completions + "
                     "each step's extra sequences alone)",
            "columns": ["dtype", "arm", "s/step", "paired: arm s", "paired: floor s", "step/floor", "peak RSS MiB",
                        "floor RSS MiB", "largest phases (s)"],
            "rows": rows,
            "note": _note(results),
        },
    }  # fmt: skip
    print(
        f"\n{'dtype':<8}{'arm':<28}{'s/step':>8}{'paired':>8}{'floor':>8}{'ratio':>7}{'RSS':>7}{'floorRSS':>9}"
    )
    for r in rows:
        flag = "" if float(r[5]) <= TARGET else "  > target"
        print(f"{r[0]:<8}{r[1]:<28}{r[2]:>8.3f}{r[3]:>8.3f}{r[4]:>8.3f}{r[5]:>7}{r[6]:>7}{r[7]:>9}{flag}")
    for dtype, arms_ in results.items():
        for name, e in arms_.items():
            print(f"\n{dtype} {name}: phases (median s, calls, padded tokens, real tokens)")
            for k, v in sorted(e["arm"]["phase_medians"].items(), key=lambda kv: -kv[1]["seconds"]):
                print(
                    f"  {k:<34}{v['seconds']:>8.3f}{v['calls']:>6g}{v['padded_tokens']:>9g}{v['real_tokens']:>9g}"
                )
            for k, v in ((e["floor_process"] or {}).get("extras") or {}).items():
                print(
                    f"  floor extra: {k:<34}{v['median']:>8.3f}  {v['rows']} x {v['width']} ({v['real_tokens']} real, "
                    f"{v['distinct_rows']} distinct rows)"
                )
    out_dir = Path(os.environ.get("COMPOSER_BENCH_OUT", "bench-results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "bench_profile.json", data)
    print(f"wrote {(out_dir / 'bench_profile.json').resolve()}")


if __name__ == "__main__":
    main()
