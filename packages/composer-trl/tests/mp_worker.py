"""Worker of test_multiprocess.py, launched by torchrun: 2 CPU processes (gloo) via accelerate's DDP.

Not a test module itself (pytest only collects test_*.py)."""

from __future__ import annotations

import json
import os
import sys

import torch


def main(out_dir: str, model_dir: str, mode: str = "hints") -> None:
    """``mode``: ``hints`` (hint_fn, groups of 4 on one rank each), ``success-ema`` (successful siblings, an
    EMA teacher, one group of 8 split across the two ranks) or ``on-policy`` (channel 3 on the student's failures,
    one group of 8 split across the two ranks; each rank records its rewards)."""
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("COMPOSER_MP_DUMP_AFTER", "300")), exit=True)
    from composer_core.tasks.digit_reversal import make_dataset_rows, reverse_hints, reverse_reward
    from composer_trl import ComposerGRPOConfig, ComposerGRPOTrainer
    from datasets import Dataset

    torch.set_num_threads(1)
    tok_dir = model_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    data = Dataset.from_list(make_dataset_rows(64, seed=1))
    seen: list[list[float]] = []

    def recorded_reward(completions: list[str], **kwargs: object) -> list[float]:
        seen.append([float(r) for r in reverse_reward(completions=completions, **kwargs)])
        return seen[-1]

    on_policy = mode == "on-policy"
    if on_policy:
        data = data.remove_columns(["rejected"])
    args = ComposerGRPOConfig(
        output_dir=os.path.join(out_dir, "trainer"),
        per_device_train_batch_size=4,
        num_generations=4 if mode == "hints" else 8,
        max_completion_length=3,
        max_steps=2,
        learning_rate=3e-3,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
        bf16=False,
        dpo_variant="dpo",
        log_channel_grad_norms=on_policy,  # the on-policy test compares them across ranks
        alpha_sdpo=0.0 if on_policy else 1.0,
        **({"beta_replay": 1.0} if mode != "success-ema" else {}),
        **(
            {"sdpo_teacher_context": "success", "success_reward_threshold": 0.3}
            | {"sdpo_teacher": "ema", "teacher_update_rate": 0.5, "beta_replay": 0.0}
            if mode == "success-ema"
            else {}
        ),
        **({"replay_pairs": "on_policy", "success_reward_threshold": 0.3} if on_policy else {}),
    )
    trainer = ComposerGRPOTrainer(
        model=model_dir,
        reward_funcs=[recorded_reward if on_policy else reverse_reward],
        args=args,
        train_dataset=data,
        processing_class=tok,
        **({"hint_fn": reverse_hints} if mode == "hints" else {}),
    )
    before = sum(float(p.detach().double().sum()) for p in trainer.model.parameters())
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    after = sum(float(p.detach().double().sum()) for p in model.parameters())
    rank = trainer.accelerator.process_index
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "param_sum_before": before,
        "param_sum_after": after,
        "logs": [r for r in trainer.state.log_history if "reward" in r],
        "rewards": seen,
        "teacher_sum": None
        if trainer._sdpo_teacher is None
        else sum(float(p.detach().double().sum()) for p in trainer._sdpo_teacher.parameters()),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # Tear the gloo group down before the interpreter exits: left alive, its C++ threads are destroyed during
    # teardown and a rank can abort ("terminate called without an active exception") after a passing run.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # Everything this rank had to say is on disk and the process group is gone: exit here, before main's locals
    # (trainer, accelerator, model) are freed. Their destructors and the interpreter's teardown are where a rank
    # hung past the watchdog under load, twice in CI after a passing run (the dump showed no Python frame below
    # the call of main: a destructor run as main returned).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
