#!/usr/bin/env bash
# Regenerate the AI flame graph example (README.md beside this file says what is real and what is not):
#   1. build mlp.cu into libmlp.so with nvcc from the NVIDIA wheels (`make setup` installs them),
#   2. profile `python train.py libmlp.so` with aiflame (root: BPF), which probes its CUDA launches,
#   3. write CUPTI PC-sampling records for the launched kernels' real instructions (cupti_records.py),
#   4. import them into the capture, and export the stall view as folded stacks and SVG here.
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
if [ ! -x "$CUDA/bin/nvcc" ]; then
    echo "make.sh: no nvcc under $CUDA (install the NVIDIA wheels: make setup)" >&2
    exit 1
fi
rm -rf "$WORK"
mkdir -p "$WORK/lib"
ln -s "$CUDA/lib/libcudart.so.13" "$WORK/lib/libcudart.so"  # the wheel ships only the versioned name

echo "== build libmlp.so (sm_80 and sm_90 SASS, line tables)"
PATH="$CUDA/bin:$PATH" "$CUDA/bin/nvcc" -g -lineinfo -cudart shared \
    -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 \
    -L "$WORK/lib" -Xlinker "-rpath=$CUDA/lib" -shared -Xcompiler -fPIC -Xcompiler -fno-omit-frame-pointer \
    -o "$WORK/libmlp.so" "$HERE/mlp.cu"

echo "== profile the training script ($STEPS steps)"
cd "$HERE"
# `python train.py` would make the script's path absolute (this checkout's path in every Python frame); compiled
# under its relative name the frames read train.py:LINE, below one `<module> (<string>:1)` frame of -c.
RUN='import sys; sys.argv[0] = "train.py"; exec(compile(open("train.py").read(), "train.py", "exec"))'
"$PY" -m aiflame profile -q -o "$WORK/run" --formats folded -- \
    "$PY" -c "$RUN" "$WORK/libmlp.so" --steps "$STEPS"

echo "== CUPTI records for the launched kernels (synthesized counts, real instructions)"
"$PY" cupti_records.py "$WORK/run/profile.aiflame" -o "$WORK/cupti.stream"

echo "== import and export the AI flame graph"
"$PY" -m aiflame import "$WORK/run/profile.aiflame" "$WORK/cupti.stream" -f cupti -o "$WORK/ai.aiflame"
"$PY" -m aiflame export "$WORK/ai.aiflame" --view stalls -f folded -o "$HERE/stalls.folded"
"$PY" -m aiflame export "$WORK/ai.aiflame" --view stalls -f svg -o "$HERE/stalls.svg" \
    --opt "title=AI flame graph: MLP training step (CUDA, driven from Python)" \
    --opt "subtitle=real launch stacks, kernels, SASS and source lines; stall counts and reasons synthesized (no GPU, see README)"
echo "done: $HERE/stalls.folded, $HERE/stalls.svg (capture and records in $WORK)"
