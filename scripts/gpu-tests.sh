#!/usr/bin/env bash
# The suite's real-GPU tests (tests/integration/test_gpu_host.py) on a lent NVIDIA GPU machine; docs/gpu-testing.md.
#   here, after `make setup`:     scripts/gpu-tests.sh bundle   (.gpu/ from make-bundle, plus pytest's wheels)
#   on the GPU machine (root):    bash .gpu/host.sh bash scripts/gpu-tests.sh run [PYTEST ARGS]
# The GPU machine has no package registry: `bundle` downloads the pure-Python wheels pytest needs into .gpu/test/,
# `run` installs them beside the bundle's and runs the GPU tests (with -rs: a skip says why). Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
bundle)
    [ -e .gpu/host.sh ] || ../shared/tools/gpu/make-bundle
    rm -rf .gpu/test && mkdir -p .gpu/test
    for p in pytest pluggy iniconfig packaging pygments hypothesis sortedcontainers; do
        v=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$p'))")
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux2014_x86_64 -d .gpu/test "$p==$v"
    done
    echo "gpu-tests: .gpu/test/ holds $(ls .gpu/test | wc -l) wheels; carry .gpu with the checkout"
    ;;
run)
    shift
    T=/opt/aiflame-test
    if [ ! -e "$T/ready" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$T" .gpu/test/*.whl
        touch "$T/ready"
    fi
    export PYTHONPATH=$T${PYTHONPATH:+:$PYTHONPATH} PATH=$PATH:/usr/local/cuda/bin
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
    # test_launch_budget on a GPU: cudart's launches reach the driver's probed cuLaunchKernel for real, and the
    # per-kernel counts must still equal the program's own (one launch, not two; the return of a launch counted
    # without a record is not probed where the GPU host's kernel has uprobe session links, 6.13+)
    exec python3 -m pytest -p no:cacheprovider -rs -v tests/integration/test_gpu_host.py \
        tests/integration/test_launch_budget.py "$@"
    ;;
*)
    echo "usage: scripts/gpu-tests.sh bundle | run [PYTEST ARGS]" >&2
    exit 2
    ;;
esac
