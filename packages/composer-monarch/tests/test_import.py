from importlib.metadata import version

import composer_monarch


def test_version_matches_distribution_metadata() -> None:
    assert composer_monarch.__version__ == version("composer-monarch") == "0.1.0"


def test_ships_py_typed() -> None:
    from importlib.resources import files

    assert files("composer_monarch").joinpath("py.typed").is_file()


def test_spawn_bootstrap_imports_every_actor_module_in_a_fresh_process() -> None:
    """The driver's ``spawn_procs(bootstrap=...)`` callable, unpickled and run in a fresh interpreter as Monarch
    does, leaves composer_monarch, every actor module and the Qwen2 model code imported (one thread, before the
    actors' threads import concurrently)."""
    import pickle
    import subprocess
    import sys

    from composer_monarch.driver import ComposerDriver

    bootstrap = ComposerDriver.start.__globals__["prepare_process"]
    wanted = ["composer_monarch", "transformers.models.qwen2"] + [
        f"composer_monarch.{m}"
        for m in ("trainer", "generator", "rewarder", "teacher", "forge_loss", "model")
    ]
    code = (
        "import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1]))(); "
        f"print(sorted(m for m in {wanted!r} if m not in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, pickle.dumps(bootstrap).hex()],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stderr
