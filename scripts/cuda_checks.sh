#!/usr/bin/env bash
# Every CUDA test and GPU benchmark of the workspace in one run, for a maintainer's machine with an NVIDIA GPU
# (CI has none, so these only run here). Needs a Python ($PYTHON, default python3) with CUDA torch and pytest,
# composer-core, composer-prime-rl, composer-trl and composer-diloco installed in it (any version: the
# workspace's sources are put first on PYTHONPATH, but each package reads its version from the installed
# distribution), e.g. `pip install --no-deps ./packages/composer-core ./packages/composer-prime-rl
# ./packages/composer-trl ./packages/composer-diloco`, and their upstreams (trl with datasets, torchft);
# bench_jsd.py also needs liger-kernel (TRL and Liger are its peers).
#
#   bash scripts/cuda_checks.sh            # tests, then both GPU benches (about 10 minutes on one H200)
#   OUT=/tmp/cuda bash scripts/cuda_checks.sh tests    # only the tests;  ... benches: only the benches
#
# Writes under $OUT (default ./cuda-results): one log per step and the benches' JSON
# (bench_jsd_cuda.json, bench_composer_loss_cuda.json). Copy the JSON into each package's bench/results/ and
# run scripts/bench_tables.py to regenerate the READMEs' CUDA tables. Exits non-zero at the first failing step.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-cuda-results}
WHAT=${1:-all}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SRC=("$PWD"/packages/composer-{core,prime-rl,trl,diloco}/src)
export PYTHONPATH="$(IFS=:; echo "${SRC[*]}")${PYTHONPATH:+:$PYTHONPATH}"
export COMPOSER_BENCH_OUT="$OUT"
"$PYTHON" -c "import torch" 2>/dev/null || { echo "cuda_checks.sh: $PYTHON cannot import torch: set PYTHON" >&2; exit 2; }
"$PYTHON" -c "import torch; torch.cuda.is_available() or exit('cuda_checks.sh: torch sees no CUDA device')"
"$PYTHON" -c "import importlib.metadata as m
[m.version(d) for d in ('composer-core', 'composer-prime-rl', 'composer-trl', 'composer-diloco', 'trl', 'torchft')]" \
    2>/dev/null || {
    echo "cuda_checks.sh: composer-core, composer-prime-rl, composer-trl and composer-diloco (with trl and" \
        "torchft) are not installed in $PYTHON: pip install --no-deps ./packages/composer-core" \
        "./packages/composer-prime-rl ./packages/composer-trl ./packages/composer-diloco, plus trl datasets" \
        "torchft (or wheels built elsewhere)" >&2
    exit 2
}

step() {  # step NAME DIR COMMAND...: run COMMAND in DIR, its output into $OUT/NAME.log and on the terminal
    local name=$1 dir=$2
    shift 2
    echo "== $name" >&2
    (cd "$dir" && "$@") 2>&1 | tee "$OUT/$name.log"
}

if [[ $WHAT == all || $WHAT == tests ]]; then
    # composer-core: host syncs counted under set_sync_debug_mode, precision under CUDA autocast, the compiled
    # JSD kernel (tests/loss; -k cuda: the CUDA cases, the CPU ones run in CI)
    step tests-core-loss packages/composer-core "$PYTHON" -m pytest -q -p no:cacheprovider tests/loss -k cuda
    # composer-prime-rl: the loss under set_sync_debug_mode("error"), per sample, packed and with an rl stream
    step tests-prime-rl-device packages/composer-prime-rl \
        "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_device_checks.py
    # composer-trl: all three channels training under bf16 on the GPU (dense and MoE), loss and gradient = CPU's
    step tests-trl-cuda packages/composer-trl "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
    # composer-diloco: CUDA tensors averaged in place (= the CPU round bit for bit), DiLoCo on a CUDA model
    step tests-diloco-cuda packages/composer-diloco "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
fi
if [[ $WHAT == all || $WHAT == benches ]]; then
    step bench-jsd-cuda packages/composer-core "$PYTHON" bench/bench_jsd.py --device cuda --inner 10 --rounds 2
    step bench-prime-rl-cuda packages/composer-prime-rl "$PYTHON" bench/bench_composer_loss.py --device cuda
fi
echo "cuda_checks.sh: done; logs and JSON in $OUT" >&2
