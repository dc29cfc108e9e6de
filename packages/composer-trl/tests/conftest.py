"""Shared fixtures: one tiny Qwen2 saved to a local directory, the digit-reversal dataset, trainer factories.

Everything is real: trl 1.16's GRPOTrainer, transformers' Qwen2, datasets, peft. The model is tiny
(hidden 64, 2 layers) so each trainer builds in about a second on CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from composer_core.tasks.digit_reversal import ALPHABET
    from composer_core.tasks.tiny import build_char_tokenizer

    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A saved tiny model + tokenizer (TRL builds its reference model from a path when beta != 0)."""
    from composer_core.tasks.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-qwen2")
    build_tiny_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """A saved tiny mixture-of-experts Qwen2 (4 experts, 2 per token) + tokenizer."""
    from composer_core.tasks.tiny import TinyModelConfig, build_tiny_model

    cfg = TinyModelConfig(hidden_size=32, intermediate_size=64, num_experts=4, num_experts_per_tok=2)
    model = build_tiny_model(tokenizer, cfg, seed=0)
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert (
        model.config.router_aux_loss_coef > 0
    )  # the default coefficient (0.001) is what GRPOTrainer applies
    path = tmp_path_factory.mktemp("tiny-qwen2-moe")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def rows() -> list[dict[str, Any]]:
    from composer_core.tasks.digit_reversal import make_dataset_rows

    return make_dataset_rows(256, seed=1)


@pytest.fixture(scope="session")
def dataset(rows: list[dict[str, Any]]) -> Any:
    from datasets import Dataset

    return Dataset.from_list(rows)


BASE_ARGS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "max_completion_length": 3,
    "max_steps": 2,
    "learning_rate": 3e-3,
    "report_to": "none",
    "use_cpu": True,
    "save_strategy": "no",
    "disable_tqdm": True,
    "logging_steps": 1,
    "seed": 0,
    "lr_scheduler_type": "constant",
}


def grpo_args(tmp_path: Path, composer: bool = True, **overrides: Any) -> Any:
    from composer_trl import ComposerGRPOConfig
    from trl import GRPOConfig

    if not composer:
        return GRPOConfig(output_dir=str(tmp_path / "out"), **{**BASE_ARGS, **overrides})
    # the tests of the channels switch both on unless they say otherwise (the library's default is off)
    channels = {"alpha_sdpo": 1.0, "beta_replay": 1.0}
    return ComposerGRPOConfig(output_dir=str(tmp_path / "out"), **{**BASE_ARGS, **channels, **overrides})


def make_trainer(
    model: Any, tokenizer: Any, dataset: Any, args: Any, *, composer: bool = True, **kwargs: Any
) -> Any:
    from composer_core.tasks.digit_reversal import reverse_reward
    from composer_trl import ComposerGRPOTrainer
    from trl import GRPOTrainer

    cls = ComposerGRPOTrainer if composer else GRPOTrainer
    return cls(
        model=str(model) if isinstance(model, Path) else model,
        reward_funcs=[reverse_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **kwargs,
    )


def generation_batch(dataset: Any, n_prompts: int, g: int, start: int = 0) -> list[dict[str, Any]]:
    """What TRL's RepeatSampler hands `_generate_and_score_completions`: each row `g` times in a row."""
    return [dict(dataset[i]) for i in range(start, start + n_prompts) for _ in range(g)]


@pytest.fixture(scope="session")
def h() -> Any:
    """The helpers above (test modules cannot import conftest under --import-mode=importlib)."""
    from types import SimpleNamespace

    return SimpleNamespace(grpo_args=grpo_args, make_trainer=make_trainer, generation_batch=generation_batch)


def _bench_module(name: str) -> Any:
    """``bench/<name>.py`` loaded by path (bench/ holds scripts, not a package)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module's namespace through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def paired_stats() -> Any:
    return _bench_module("paired_stats")


@pytest.fixture(scope="session")
def addition_budget() -> Any:
    return _bench_module("addition_budget")


@pytest.fixture(scope="session")
def bench() -> Any:
    """The comparison scripts of ``bench/`` loaded by path: ``bench.compare_tiny``, ``bench.compare_smollm2``,
    ``bench.paired_stats`` and their shared ``bench._compare``, each registered under its file name (the scripts
    import one another by it, as they do when run from ``bench/``)."""
    import sys
    from types import SimpleNamespace

    names = ("_compare", "paired_stats", "compare_tiny", "compare_smollm2")
    return SimpleNamespace(**{n: sys.modules.get(n) or _bench_module(n) for n in names})
