"""Every command, module, file and config key an error message of composer-verl names exists.

The messages are read from the source (AST): the strings of every ``raise`` and of every
``warnings.warn`` / ``logger.*`` call, plus the strings of the names those reference (message constants).
Then each of these must resolve:

* ``python -m X``: X is importable and runnable (a module, or a package with ``__main__``);
* dotted paths under ``composer_verl``, ``composer_core`` or ``verl``: a module, or an attribute of one;
* ``pkg.module/file.yaml``: that file ships inside the package;
* verl config keys (``actor_rollout_ref.…``, ``trainer.…``, ``algorithm.…``, ``+ray_kwargs.…``): present in
  verl's own ``ppo_trainer`` config composed by Hydra (a ``+`` key: its parent exists); for the keys that
  select a registered component (adv estimator, policy loss, v1 trainer mode), the value is registered;
* ``composer.key``: a key of the ``composer:`` section;
* ``key=value`` with a bare key: a ``composer:`` section key or a key of verl's config.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import composer_verl
import composer_verl.plugin  # registers the estimator, loss and trainer mode
import pytest
from composer_verl.config import section_keys
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

SOURCE = Path(composer_verl.__file__).parent
MESSAGE_CALLS = {"warn", "error", "warning", "exception", "critical"}
ROOTS = (
    "actor_rollout_ref",
    "algorithm",
    "trainer",
    "critic",
    "reward",
    "reward_model",
    "ray_kwargs",
    "data",
)

PYTHON_M = re.compile(r"python -m ([A-Za-z_][\w.]*)")
DOTTED = re.compile(r"(?<![\w.])((?:composer_verl|composer_core|verl)(?:\.[A-Za-z_]\w*)+)")
RESOURCE = re.compile(r"(?<![\w.])((?:composer_verl|composer_core|verl)(?:\.\w+)*)/([\w.-]+\.ya?ml)")
CONFIG_KEY = re.compile(
    r"(?<![\w.])(\+?(?:" + "|".join(ROOTS) + r")(?:\.[A-Za-z_]\w*)+)(?:=([\w-]+(?:\.[\w-]+)*))?"
)
SECTION_KEY = re.compile(r"(?<![\w.+])composer\.([a-z_][a-z0-9_]*)")
BARE_ASSIGN = re.compile(r"(?<![\w.+'\"{])([a-z_][a-z0-9_]*)=(?!=)")
REGISTRIES = {
    "algorithm.adv_estimator": "adv",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "loss",
    "trainer.v1.trainer_mode": "trainer",
}


def _text(node: ast.AST) -> str:
    """A message expression as text: literal parts kept, every formatted value as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return "\n".join(_text(c) for c in ast.iter_child_nodes(node))


def _messages(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text())
    assigned: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)
    for node in ast.walk(tree):
        is_message = isinstance(node, ast.Raise) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MESSAGE_CALLS
        )
        if not is_message:
            continue
        yield _text(node)
        for name in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}:
            for value in assigned.get(name, []):
                yield _text(value)


def _all_messages() -> list[tuple[str, str]]:
    return [(p.name, m) for p in sorted(SOURCE.rglob("*.py")) for m in _messages(p) if m.strip()]


@pytest.fixture(scope="module")
def verl_config() -> DictConfig:
    config_dir = str(files("verl.trainer.config"))
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer")


def _leaf_paths(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, DictConfig):
        for key in node:
            path = f"{prefix}.{key}" if prefix else str(key)
            yield path
            yield from _leaf_paths(node._get_node(key), path)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module_name)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        obj: Any = importlib.import_module(module_name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _runnable(module: str) -> bool:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:  # a parent package is missing
        spec = None
    if spec is None:
        return False
    return (
        spec.submodule_search_locations is None or importlib.util.find_spec(module + ".__main__") is not None
    )


def _registered(kind: str, value: str) -> bool:
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.v1 import get_trainer_cls

    lookup = {
        "adv": core_algos.get_adv_estimator_fn,
        "loss": core_algos.get_policy_loss_fn,
        "trainer": get_trainer_cls,
    }[kind]
    try:
        lookup(value)
    except (KeyError, ValueError, NotImplementedError):
        return False
    return True


def problems(messages: list[tuple[str, str]], verl_config: DictConfig) -> list[str]:
    """Every name in ``messages`` that does not resolve, as ``file: what``."""
    paths = set(_leaf_paths(verl_config))
    last_parts = {p.rsplit(".", 1)[-1] for p in paths}
    composer_keys = set(section_keys())
    found: list[str] = []
    for where, text in messages:
        for module in PYTHON_M.findall(text):
            if not _runnable(module):
                found.append(f"{where}: `python -m {module}` is not a runnable module")
        for dotted in DOTTED.findall(text):
            if not _resolves(dotted.rstrip(".")):
                found.append(f"{where}: {dotted} is neither a module nor an attribute of one")
        for package, name in RESOURCE.findall(text):
            if not files(package).joinpath(name).is_file():
                found.append(f"{where}: {package}/{name} is not a file of {package}")
        for key, value in CONFIG_KEY.findall(text):
            if key.startswith("data.batch"):  # DataProto.batch[...], not a config key
                continue
            bare = key.lstrip("+")
            if key.startswith("+"):  # adds a key: some parent below the root section must exist
                parts = bare.split(".")
                if not any(".".join(parts[:i]) in paths for i in range(2, len(parts))):
                    found.append(f"{where}: +{bare}: no parent of it in verl's config")
            elif bare not in paths:
                found.append(f"{where}: {bare} is not a key of verl's config")
            if bare in REGISTRIES and value and not _registered(REGISTRIES[bare], value):
                found.append(f"{where}: {bare}={value} is not registered with verl")
        for key in SECTION_KEY.findall(text):
            if key not in composer_keys:
                found.append(f"{where}: composer.{key} is not a key of the composer section")
        for key in BARE_ASSIGN.findall(text):
            if key not in composer_keys and key not in last_parts:
                found.append(f"{where}: {key}= is neither a composer section key nor a verl config key")
    return found


def test_messages_are_found() -> None:
    """The scan sees the messages it must check (a scan that reads nothing cannot fail)."""
    text = "\n".join(m for _, m in _all_messages())
    for expected in ("composer actor extension", "grpo_composer needs group ids", "could not register"):
        assert expected in text


def test_every_name_in_an_error_message_exists(verl_config: DictConfig) -> None:
    assert problems(_all_messages(), verl_config) == []


def test_the_checker_catches_what_does_not_exist(verl_config: DictConfig) -> None:
    bad = [
        ("x", "run python -m composer_verl.main_ppo"),
        ("x", "see composer_verl.actor.NoSuchWorker"),
        ("x", "set actor_rollout_ref.actor.no_such_key=1"),
        ("x", "set trainer.v1.trainer_mode=no_such_mode"),
        ("x", "set no_such_option=0"),
        ("x", "+ray_kwargs.no_such_section.x=1"),
        ("x", "set composer.no_such_option=1"),
        ("x", "use composer_verl.examples/no_such.yaml"),
    ]
    assert [item for item in bad if not problems([item], verl_config)] == []
    good = [
        ("x", "run python -m verl.trainer.main_ppo trainer.v1.trainer_mode=composer_sync"),
        (
            "x",
            "actor_rollout_ref.actor.policy_loss.loss_mode=composer, algorithm.adv_estimator=grpo_composer",
        ),
        ("x", "+ray_kwargs.ray_init.runtime_env.env_vars.X, alpha_sdpo=0, clip_ratio_c=3, composer.hint_fn"),
        ("x", "composer_verl.examples/composer_grpo.yaml, composer_verl.batch.with_composer_batch"),
    ]
    assert problems(good, verl_config) == []
