# composer-trl[openenv]: the README's `--env openenv:<url>` run against the digit-reversal OpenEnv server
# (python -m composer_core.envs.openenv_digit_reversal, a real process) trains all three channels.
import socket
import time
import urllib.request

installed_from_wheel("composer-core", "composer_core")
installed_from_wheel("composer-trl", "composer_trl")
importlib.import_module("composer_core.envs.openenv")  # the extra's adapter imports
SMALL = ["--per_device_train_batch_size", "64", "--num_generations", "8", "--max_completion_length", "3"]
out_dir = WORK / "composer-train-openenv"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
server = subprocess.Popen(
    [sys.executable, "-m", "composer_core.envs.openenv_digit_reversal", "--port", url.rsplit(":", 1)[1],
     "--n-tasks", "64", "--min-digits", "2", "--max-digits", "2"],
)  # fmt: skip
try:
    deadline = time.monotonic() + 240
    while True:  # the server's /health answers once it is up
        assert server.poll() is None and time.monotonic() < deadline, f"OpenEnv server not up at {url}"
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            break
        except OSError:
            time.sleep(0.25)
    log = run(
        BIN / "composer-train", "--env", f"openenv:{url}", "--steps", "2", "--output-dir", out_dir,
        "--no-plot", *SMALL, timeout=900,
    )  # fmt: skip
finally:
    server.terminate()
    server.wait(timeout=30)
rows = [json.loads(x) for x in (out_dir / "metrics-composer.jsonl").read_text().splitlines() if x.strip()]
assert [r["step"] for r in rows] == [1, 2], f"{rows}\n{log[-3000:]}"
for r in rows:
    assert r["composer/loss/sdpo"] > 0 and r["composer/loss/replay"] > 0, r
assert json.loads((out_dir / "summary.json").read_text())["status"] == "finished"
print(f"ok: composer-train --env openenv:{url} --steps 2: sdpo and replay losses > 0 at every step")
