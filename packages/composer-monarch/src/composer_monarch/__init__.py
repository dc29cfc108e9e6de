"""composer_monarch: composer's 3-channel objective on Monarch actors (trainer, generator, rewarder, teacher).

- :class:`ComposerLoss` — TorchForge-compatible loss callable ``loss(logits, **targets)``.
- :class:`ComposerDriver` / :func:`run_grpo` — spawn the actors on a proc mesh and run the GRPO loop.
- Actors: :class:`TrainerActor`, :class:`GeneratorActor`, :class:`RewarderActor`, :class:`TeacherActor`.
"""

from importlib.metadata import version as _version

from composer_monarch.driver import ComposerDriver, LoopConfig, StepResult, run_grpo
from composer_monarch.errors import ActorCrashedError, ActorTimeoutError
from composer_monarch.forge_loss import ComposerLoss
from composer_monarch.generator import GeneratorActor, SamplingConfig
from composer_monarch.model import TinyQwen2
from composer_monarch.rewarder import RewarderActor
from composer_monarch.rollout import PreferencePairs, Rollout, TrainBatch
from composer_monarch.task import EnvBoundTask, ReverseDigits, Task
from composer_monarch.teacher import ReplayRecord, TeacherActor
from composer_monarch.trainer import PolicyTrainer, TrainerActor, TrainerConfig

__version__ = _version("composer-monarch")

__all__ = [
    "ActorCrashedError",
    "ActorTimeoutError",
    "ComposerDriver",
    "ComposerLoss",
    "EnvBoundTask",
    "GeneratorActor",
    "LoopConfig",
    "PolicyTrainer",
    "PreferencePairs",
    "ReplayRecord",
    "ReverseDigits",
    "RewarderActor",
    "Rollout",
    "SamplingConfig",
    "StepResult",
    "Task",
    "TeacherActor",
    "TinyQwen2",
    "TrainBatch",
    "TrainerActor",
    "TrainerConfig",
    "__version__",
    "run_grpo",
]
