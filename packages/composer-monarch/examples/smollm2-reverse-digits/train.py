"""composer's three channels on Monarch actors for a Hugging Face causal LM (default: SmolLM2-135M-Instruct).

    python train.py                                      # HuggingFaceTB/SmolLM2-135M-Instruct from the hub
    python train.py --model /path/to/SmolLM2-135M-Instruct --steps 20

Starts a local proc mesh (``ComposerDriver``: trainer alone on one process, generator + rewarder + teacher on the
other) and runs GRPO steps with ``ComposerLoss`` on composer_core's digit-reversal task, written into the model's
own chat template:

- channel 1: group advantages of the task's reward (fraction of right digits);
- channel 2: the teacher (the same model, synced each step) reads each wrong answer's context with the verifier's
  feedback in front of the prompt; the trainer distills toward it (``--alpha-sdpo``);
- channel 3: the correct answer replayed as a teacher action, preferred over a worse sampled answer
  (``--beta-replay``).

CPU only (the actors keep their models on CPU); see README.md next to this file.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from composer_core.tasks import digit_reversal as rules
from composer_monarch import ComposerDriver, ComposerLoss, LoopConfig, ReplayRecord
from composer_monarch.task import hinted_rows
from composer_monarch.trainer import TrainerConfig
from torch import Tensor, nn

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTRUCTION = "Reverse the digits before '>'. Answer with the digits only: "
_MARK = "\x00"  # stands for the task text while the chat template is rendered once


@dataclass(frozen=True)
class HFCausalLM:
    """Picklable model factory: every actor loads its own copy of ``path`` (a hub id or a local directory)."""

    path: str
    dtype: str = "float32"

    def __call__(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model: nn.Module = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, self.dtype))
        return model


class ChatReverseDigits:
    """composer_core's digit-reversal rules on a Hugging Face tokenizer's ids (the ``Task`` the driver runs).

    A prompt is the model's chat template around ``instruction + "381>"``, and the task's characters (digits,
    ``>``, ``|``, ``.``) are one token each, so every prompt and every hinted prompt of one digit count has one
    length (the loop does not left-pad). The hinted context (channel 2) is the verifier's feedback in front of the
    task text (``".8.|381>"``, composer_core's layout); a right answer has no hint. Reward = ``rules.verify`` on the
    decoded answer.
    """

    def __init__(self, model: str, *, length: int = 3, instruction: str = INSTRUCTION, seed: int = 0) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.length, self.seed = length, seed
        tok = self.tokenizer
        self.ids: dict[str, int] = {}
        for ch in rules.ALPHABET:
            ids = tok.encode(ch, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(
                    f"{model}: {ch!r} is {len(ids)} tokens; the task needs one token per character"
                )
            self.ids[ch] = ids[0]
        self.chars = {i: ch for ch, i in self.ids.items()}
        text = instruction + _MARK
        if tok.chat_template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        before, after = str(text).split(_MARK)
        self.prefix = tok.encode(before, add_special_tokens=False)
        self.suffix = tok.encode(after, add_special_tokens=False)
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.vocab_size = len(tok)
        self.max_new_tokens = length + 2  # the digits, <eos>, and one token of slack

    def encode(self, text: str) -> list[int]:
        return [*self.prefix, *(self.ids[ch] for ch in text), *self.suffix]

    def text(self, prompt: Tensor) -> str:
        """The task text (``"381>"``, or a hinted ``".8.|381>"``) of a prompt's ids."""
        body = prompt.tolist()[len(self.prefix) : len(prompt) - len(self.suffix)]
        return "".join(self.chars[i] for i in body)

    def answer(self, completion: Tensor) -> str:
        ids = completion.tolist()
        ids = ids[: ids.index(self.eos_id)] if self.eos_id in ids else ids
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def prompts(self, n: int, *, step: int) -> Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        digits = torch.randint(0, 10, (n, self.length), generator=g).tolist()
        return torch.tensor([self.encode(rules.make_prompt("".join(map(str, d)))) for d in digits])

    def target(self, prompt: Tensor) -> Tensor:
        """The right answer's ids (+ EOS): the replayed teacher action of channel 3."""
        return torch.tensor([self.ids[ch] for ch in rules.oracle_solve(self.text(prompt))] + [self.eos_id])

    def hinted_prompts(
        self, prompts: Tensor, completions: Tensor, completion_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        pairs = [
            (self.text(p), self.answer(c[m])) for p, c, m in zip(prompts, completions, completion_mask.bool())
        ]
        return hinted_rows(pairs, self.length, self.encode)

    def reward(self, prompt: Tensor, completion: Tensor) -> float:
        return rules.verify(self.text(prompt), self.answer(completion))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=MODEL, help="hub id or local directory of a causal LM + tokenizer")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--length", type=int, default=3, help="digits per prompt")
    p.add_argument("--instruction", default=INSTRUCTION, help="text before the task in the user message")
    p.add_argument("--alpha-sdpo", type=float, default=0.5)
    p.add_argument("--beta-replay", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--procs", type=int, default=2, help="processes of the local mesh (1: all roles on one)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per actor process")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any one actor call may take")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    task = ChatReverseDigits(args.model, length=args.length, instruction=args.instruction)
    loop = LoopConfig(
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        procs=args.procs,
        num_threads=args.threads,
        call_timeout_s=args.timeout,
        start_timeout_s=args.timeout,
    )
    loss = ComposerLoss(
        loss_type="grpo", alpha_sdpo=args.alpha_sdpo, beta_replay=args.beta_replay, dpo_beta=0.1
    )
    # channel 3's teacher actions: the right answer to every prompt the run will sample
    replay = [
        ReplayRecord(p, task.target(p), 1.0, "oracle")
        for s in range(args.steps + 1)
        for p in task.prompts(args.prompts_per_step, step=s)
    ]
    rows = []
    with ComposerDriver(
        task,
        HFCausalLM(args.model, args.dtype),
        loss=loss,
        loop=loop,
        trainer=TrainerConfig(lr=args.lr, num_threads=args.threads),
        replay=replay if args.beta_replay else None,
    ) as driver:
        for r in driver.run(progress=False):
            row = {
                "step": r.step,
                "reward_mean": r.reward_mean,
                "pairs": r.extra["pairs"],
                "seconds": r.seconds,
            }
            row.update(r.metrics)  # composer/loss/{total,policy,sdpo,replay}, composer/sdpo/tokens, ...
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
