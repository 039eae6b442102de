#!/usr/bin/env bash
# Regenerate the AI flame graph example (README.md beside this file says what is real and what is not):
#   1. build mlp.cu into libmlp.so with nvcc from the NVIDIA wheels (`make setup` installs them),
#   2. profile `python train.py libmlp.so` with aiflame (root: BPF), which probes its CUDA launches and, on a host
#      with an NVIDIA GPU, samples its kernels with CUPTI: the stall view is exported to stalls.folded/.svg here;
#   3. without a GPU: write CUPTI PC-sampling records for the launched kernels' real instructions
#      (cupti_records.py), import them into the capture, and export synthesized-stalls.folded/.svg here.
# Run as root from anywhere: examples/ai_flamegraph/make.sh   (PYTHON=... picks the interpreter, WORK=... the
# scratch directory, default out/ai_flamegraph). Takes about a minute.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
WORK=${WORK:-$REPO/out/ai_flamegraph}
STEPS=40
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

CUDA=$("$PY" -c 'import pathlib, sysconfig; print(pathlib.Path(sysconfig.get_paths()["purelib"], "nvidia", "cu13"))')
rm -rf "$WORK"
mkdir -p "$WORK/lib"
if [ -x "$CUDA/bin/nvcc" ]; then
    ln -s "$CUDA/lib/libcudart.so.13" "$WORK/lib/libcudart.so"  # the wheel ships only the versioned name
elif command -v nvcc >/dev/null; then  # a GPU host's toolkit (pip's torch brings no nvcc)
    CUDA=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); ln -s "$CUDA/lib64/libcudart.so" "$WORK/lib/"
    CUDA_LIB=$CUDA/lib64
else
    echo "make.sh: no nvcc under $CUDA nor on PATH (install the NVIDIA wheels: make setup)" >&2
    exit 1
fi

echo "== build libmlp.so (sm_80 and sm_90 SASS, line tables)"
PATH="$CUDA/bin:$PATH" "$CUDA/bin/nvcc" -g -lineinfo -cudart shared \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    -L "$WORK/lib" -Xlinker "-rpath=${CUDA_LIB:-$CUDA/lib}" -shared -Xcompiler -fPIC -Xcompiler -fno-omit-frame-pointer \
    -o "$WORK/libmlp.so" "$HERE/mlp.cu"

echo "== profile the training script ($STEPS steps)"
cd "$HERE"
# `python train.py` would make the script's path absolute (this checkout's path in every Python frame); compiled
# under its relative name the frames read train.py:LINE, below one `<module> (<string>:1)` frame of -c.
RUN='import sys; sys.argv[0] = "train.py"; exec(compile(open("train.py").read(), "train.py", "exec"))'
if [ -e /proc/driver/nvidia/version ]; then
    "$PY" -m aiflame profile -q -o "$WORK/run" --force --formats folded -- "$PY" -c "$RUN" "$WORK/libmlp.so" --steps 200
    GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    "$PY" -m aiflame export "$WORK/run/profile.aiflame" --view stalls -f folded -o "$HERE/stalls.folded"
    "$PY" -m aiflame export "$WORK/run/profile.aiflame" --view launches -f folded -o "$HERE/launches.folded"
    "$PY" -m aiflame render "$HERE/stalls.folded" -o "$HERE/stalls.svg" \
        --opt "title=AI flame graph: MLP training step (CUDA, driven from Python)" \
        --opt "subtitle=real CUPTI PC samples on an ${GPU:-NVIDIA GPU} (200 steps)"
    echo "done: $HERE/stalls.folded, $HERE/stalls.svg (real samples; capture in $WORK)"
    exit 0
fi
"$PY" -m aiflame profile -q -o "$WORK/run" --force --formats folded -- \
    "$PY" -c "$RUN" "$WORK/libmlp.so" --steps "$STEPS"

echo "== CUPTI records for the launched kernels (synthesized counts, real instructions)"
"$PY" cupti_records.py "$WORK/run/profile.aiflame" -o "$WORK/cupti.stream"

echo "== import and export the AI flame graph"
"$PY" -m aiflame import "$WORK/run/profile.aiflame" "$WORK/cupti.stream" -f cupti -o "$WORK/ai.aiflame"
"$PY" -m aiflame export "$WORK/ai.aiflame" --view stalls -f folded -o "$HERE/synthesized-stalls.folded"
"$PY" -m aiflame export "$WORK/ai.aiflame" --view stalls -f svg -o "$HERE/synthesized-stalls.svg" \
    --opt "title=AI flame graph: MLP training step (CUDA, driven from Python)" \
    --opt "subtitle=real launch stacks, kernels, SASS and source lines; stall counts and reasons synthesized (no GPU, see README)"
echo "done: $HERE/synthesized-stalls.folded, $HERE/synthesized-stalls.svg (capture and records in $WORK)"
