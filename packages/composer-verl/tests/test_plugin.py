"""Registration reaches a fresh process through verl's own plugin routes (real verl, real subprocesses)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import warnings
from importlib.metadata import entry_points

import pytest

PROBE = r"""
import json, sys
import verl                                          # plugins load here, nothing else is imported by hand
loaded_by_import = "composer_verl.plugin" in sys.modules
from verl.trainer.ppo import core_algos
out = {"loaded_by_import": loaded_by_import}
for kind, get, name in (("adv", core_algos.get_adv_estimator_fn, "grpo_composer"),
                        ("loss", core_algos.get_policy_loss_fn, "composer")):
    try:
        fn = get(name)
        out[kind] = f"{fn.__module__}.{fn.__qualname__}"
    except ValueError as e:
        out[kind] = f"ValueError: {e}"
import os
if os.environ.get("PROBE_EXTERNAL_LIB"):  # the worker-side route: HFModelConfig imports external_lib
    import tempfile
    from transformers import Qwen2Config
    from verl.workers.config import HFModelConfig
    path = tempfile.mkdtemp()
    Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, architectures=["Qwen2ForCausalLM"]).save_pretrained(path)
    HFModelConfig(path=path, load_tokenizer=False, external_lib="composer_verl.plugin")
    out["external_lib_loss"] = core_algos.get_policy_loss_fn("composer").__name__
print("PROBE" + json.dumps(out))
"""


def _spawn(env_overrides: dict[str, str]) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    env.update(env_overrides)
    return subprocess.Popen(
        [sys.executable, "-c", PROBE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("PROBE"))
    return json.loads(line[len("PROBE") :])


@pytest.fixture(scope="module")
def probes() -> dict[str, dict[str, object]]:
    """Three fresh interpreters, started together: entry point, plugins off, explicit module list."""
    procs = {
        "entry_point": _spawn({}),
        "plugins_off": _spawn({"VERL_USE_EXTERNAL_PLUGINS": "none", "PROBE_EXTERNAL_LIB": "1"}),
        "external_modules": _spawn(
            {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "composer_verl.plugin"}
        ),
    }
    return {name: _result(p) for name, p in procs.items()}


ADV = "composer_verl.advantage.compute_grpo_composer_advantage"
LOSS = "composer_verl.policy_loss.compute_policy_loss_composer"


def test_entry_point_is_declared() -> None:
    (ep,) = [ep for ep in entry_points(group="verl.plugins") if ep.name == "composer"]
    assert ep.value == "composer_verl.plugin"


def test_plain_import_verl_registers_estimator_and_loss(probes: dict[str, dict[str, object]]) -> None:
    assert probes["entry_point"] == {"loaded_by_import": True, "adv": ADV, "loss": LOSS}


def test_without_plugins_nothing_is_registered(probes: dict[str, dict[str, object]]) -> None:
    """Proves the entry point (not some other import) is what registered them above."""
    off = probes["plugins_off"]
    assert off["loaded_by_import"] is False
    assert str(off["adv"]).startswith("ValueError") and str(off["loss"]).startswith("ValueError")


def test_external_lib_alternative(probes: dict[str, dict[str, object]]) -> None:
    """actor_rollout_ref.model.external_lib: verl's HFModelConfig imports the plugin (worker side)."""
    assert probes["plugins_off"]["external_lib_loss"] == "compute_policy_loss_composer"


def test_verl_use_external_modules_alternative(probes: dict[str, dict[str, object]]) -> None:
    assert probes["external_modules"] == {"loaded_by_import": True, "adv": ADV, "loss": LOSS}


def test_registration_failure_is_loud(caplog: pytest.LogCaptureFixture) -> None:
    """verl swallows plugin errors at DEBUG level; the plugin logs at ERROR and warns before re-raising."""
    import composer_verl.plugin as plugin
    from verl.trainer.ppo import core_algos

    original = core_algos.ADV_ESTIMATOR_REGISTRY["grpo_composer"]
    core_algos.ADV_ESTIMATOR_REGISTRY["grpo_composer"] = lambda **_: None  # a foreign estimator took the name
    try:
        with (
            caplog.at_level("ERROR", logger="composer_verl"),
            pytest.warns(RuntimeWarning, match="grpo_composer"),
            pytest.raises(ValueError, match="already been registered"),
        ):
            importlib.reload(plugin)
        assert any("could not register" in r.getMessage() for r in caplog.records)
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY["grpo_composer"] = original
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            importlib.reload(plugin)  # registering the same functions again is idempotent
    assert core_algos.get_policy_loss_fn("composer").__name__ == "compute_policy_loss_composer"
