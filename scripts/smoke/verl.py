# composer-verl: a fresh `import verl` loads the plugin through verl's entry points and resolves the
# `grpo_composer` advantage estimator and the `composer` policy loss; the example YAML ships.
import importlib.resources

for key in [k for k in os.environ if k.startswith("VERL_USE_EXTERNAL")]:
    raise SystemExit(f"{key} is set; unset it so verl loads its plugins the default way")
import verl  # noqa: F401  (plugins load here; nothing of composer is imported by hand)

assert "composer_verl.plugin" in sys.modules, (
    "import verl did not load composer_verl.plugin (entry point verl.plugins)"
)
from verl.trainer.ppo import core_algos

adv = core_algos.get_adv_estimator_fn("grpo_composer")
loss = core_algos.get_policy_loss_fn("composer")
assert adv.__module__.startswith("composer_verl"), adv.__module__
assert loss.__module__.startswith("composer_verl"), loss.__module__
print(
    f"ok: import verl {metadata.version('verl')} registered grpo_composer -> {adv.__module__}.{adv.__qualname__}"
)
print(f"ok: policy loss composer -> {loss.__module__}.{loss.__qualname__}")
installed_from_wheel("composer-core", "composer_core")
installed_from_wheel("composer-verl", "composer_verl")
import yaml  # (a verl dependency)

example = importlib.resources.files("composer_verl").joinpath("examples", "composer_grpo.yaml")
config = yaml.safe_load(example.read_text())
assert isinstance(config, dict) and config, "composer_grpo.yaml is empty"
print(f"ok: composer_verl/examples/composer_grpo.yaml loads ({len(config)} top-level keys)")
