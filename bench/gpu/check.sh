#!/usr/bin/env bash
# One prepared run on a lent NVIDIA GPU machine (issue #26, with #25's figures on the side), from the project root:
#   bash .gpu/host.sh bash bench/gpu/check.sh          (.gpu/ from ../shared/tools/gpu/make-bundle)
# Stages, each bounded, most important first; a stage that would pass the budget is skipped and says so:
#   doctor's GPU section; two_kernels alone, under `aiflame profile` (stall shares vs CUDA-event GPU time) and with
#   the injection library built on aiflame's crt/ stand-in (a real CUPTI stream kept for the tests); GPT loop
#   steps/s without and with CUPTI at several periods; a 20 s GPT capture under `aiflame profile` (every view
#   exported and timed, recover); the ai_flamegraph example from real samples.
# Writes $OUT/log.txt and $OUT/results.tgz (or /tmp/gpu-out when OUT is unset). CPATH is never set: aiflame must
# find CUDA's headers itself. STAGES picks stages by name (default: all): doctor shares stream cost gpt mlp;
# COST_PERIODS the CUPTI periods of the cost stage, each run between two runs without CUPTI (default "20 20 20 22
# 24"); BUDGET the seconds the stages may take (default 480).
set -u
OUTD=${OUT:-/tmp/gpu-out}; mkdir -p "$OUTD"
W=/tmp/aiflame-gpu; rm -rf "$W"; mkdir -p "$W/res"
exec > >(tee "$OUTD/log.txt") 2>&1
T0=$(date +%s); BUDGET=${BUDGET:-480}
PY=$(realpath -s "$(command -v "${PY:-python3}")")
AF() { "$PY" -m aiflame "$@"; }
log() { echo "== [$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
pack() { tar -C "$W/res" -czf "$OUTD/results.tgz" . 2>/dev/null; }  # after each stage: a timeout keeps the rest
want() { [[ " ${STAGES:-doctor shares stream cost gpt mlp} " == *" $1 "* ]]; }
stage() {  # seconds needed, name, title
    want "$2" || return 1
    if [ "$(left)" -lt "$1" ]; then log "SKIP $3 (needs ${1}s, $(left)s left)"; return 1; fi; log "$3"
}
unset CPATH C_INCLUDE_PATH
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_LIB=$(dirname "$(dirname "$(readlink -f "$NVCC")")")/lib64
timed() {  # label, command...: the command's output, then "label: N.NN s"
    local label=$1; shift; local s; s=$(date +%s.%N)
    "$@"; local rc=$?
    echo "$label: $(python3 -c "print(round($(date +%s.%N) - $s, 2))") s (exit $rc)"
}

log "machine: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader); $(nproc) CPUs"
"$PY" -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, sys.executable)'
ls -d "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"/nvidia/cu13/include/crt 2>&1 | head -1

stage 30 doctor "doctor (GPU section)" && timeout 60 "$PY" -m aiflame doctor 2>&1 | sed -n '/NVIDIA GPU/,/daemon unit/p' | head -30

if want shares || want stream; then log "build two_kernels (shared cudart, so launches are probed)"
    timeout 90 "$NVCC" -O2 -lineinfo -gencode arch=compute_90,code=sm_90 -cudart shared -L "$CUDA_LIB" \
        -Xlinker "-rpath=$CUDA_LIB" -Xcompiler -fno-omit-frame-pointer -o "$W/two_kernels" bench/gpu/two_kernels.cu ||
    timeout 90 "$NVCC" -O2 -lineinfo -gencode arch=compute_90,code=sm_90 -o "$W/two_kernels" bench/gpu/two_kernels.cu
    ldd "$W/two_kernels" | grep cudart
fi
if stage 20 shares "two_kernels alone (3 s)"; then timeout 30 "$W/two_kernels" --seconds 3 | tee "$W/res/two_alone.json"; fi

LIBS=$(timeout 60 "$PY" bench/gpu/shim_build.py "$W/shimcache"); SHIMLIB=$(echo "$LIBS" | sed -n 1p); CUPTILIB=$(echo "$LIBS" | sed -n 2p)
log "stand-in build: $SHIMLIB (libcupti $CUPTILIB)"
inject() {  # period, command...: run with the stand-in-built injection library, streams in $W/streams-<period>
    local p=$1; shift; rm -rf "$W/streams-$p"; mkdir -p "$W/streams-$p"
    ( export CUDA_INJECTION64_PATH=$SHIMLIB AIFLAME_CUPTI_LIB=$CUPTILIB AIFLAME_CUPTI_DIR=$W/streams-$p AIFLAME_CUPTI_PERIOD=$p
      "$@" )
}
if [ -n "$SHIMLIB" ] && stage 20 stream "real CUPTI stream for the tests (two_kernels, 64 MiB, 0.4 s, stand-in build)"; then
    inject 20 timeout 30 "$W/two_kernels" --seconds 0.4 --mem-mib 64 --fma-iters 2000 | tee "$W/res/two_small.json"
    cp "$W"/streams-20/cupti-*.stream "$W/res/two_kernels.cupti.stream" && ls -l "$W/res/two_kernels.cupti.stream" && pack
    "$PY" - "$W/res/two_kernels.cupti.stream" <<'PYEOF'
import sys
from aiflame.symbolize.vendor.cupti_stream import parse_stream, stalls_from_stream
s = parse_stream(open(sys.argv[1], "rb").read())
samples, code, c = stalls_from_stream(s)
print("stream:", s.complete, len(s.batches), "batches", len(s.cubins), "cubins", dict(c), s.info, [e.stage for e in s.errors])
print("reasons:", sorted(set(s.reasons.get(next(iter(s.reasons), 0), {}).values()))[:60])
PYEOF
fi

if stage 60 shares "two_kernels under aiflame profile (6 s each, ~4.6 and ~1.15 ms kernels): stall shares vs GPU time"; then
    for cfg in "4096 32000" "1024 8000"; do
        set -- $cfg
        timeout 120 "$PY" -m aiflame profile -q -o "$W/two$1" --formats folded -- "$W/two_kernels" --seconds 6 \
            --mem-mib "$1" --fma-iters "$2" > "$W/res/two_run$1.json"
        timed "export stalls" timeout 60 "$PY" -m aiflame export "$W/two$1/profile.aiflame" --view stalls -f folded -o "$W/res/two_stalls$1.folded"
        echo "mem=$1 iters=$2 $("$PY" bench/gpu/stall_shares.py "$W/res/two_stalls$1.folded" "$W/res/two_run$1.json")" | tee -a "$W/res/two_shares.txt"
    done
    pack
fi

gpt() { timeout 90 "$@" "$PY" bench/gpu/gpt_loop.py --seconds 8 --warmup 3 | tail -1; }
if stage 110 cost "GPT loop steps/s: with CUPTI (stand-in build) at ${COST_PERIODS:-20 20 20 22 24}, each between runs without"; then
    r=$(gpt env); echo "period=none $r" | tee -a "$W/res/cupti_cost.txt"
    for p in ${COST_PERIODS:-20 20 20 22 24}; do
        [ "$(left)" -lt 40 ] && { log "SKIP the rest of the cost stage"; break; }
        r=$(inject "$p" gpt env); sz=$(du -cb "$W"/streams-"$p"/*.stream 2>/dev/null | tail -1 | cut -f1)
        echo "period=$p $r stream_bytes=${sz:-0}" | tee -a "$W/res/cupti_cost.txt"
        r=$(gpt env); echo "period=none $r" | tee -a "$W/res/cupti_cost.txt"
    done
    pack
fi

if stage 200 gpt "GPT loop under aiflame profile (20 s, defaults: CPU sampling, runtime probes, CUPTI)"; then
    s=$(date +%s)
    timeout 260 "$PY" -m aiflame profile -o "$W/gpt" --formats folded -- "$PY" bench/gpu/gpt_loop.py --seconds 20 --warmup 3 2>&1 | tail -60
    log "profile wall $(( $(date +%s) - s ))s; capture $(du -h "$W/gpt/profile.aiflame" 2>/dev/null | cut -f1)"
    ( cd examples/ai_flamegraph && stage 60 mlp "ai_flamegraph example with real samples (background)" &&
      mkdir -p "$W/mlp" &&
      "$NVCC" -g -lineinfo -cudart shared -L "$CUDA_LIB" -Xlinker "-rpath=$CUDA_LIB" \
        -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -shared -Xcompiler -fPIC -Xcompiler -fno-omit-frame-pointer -o "$W/mlp/libmlp.so" mlp.cu &&
      timeout 150 "$PY" -m aiflame profile -q -o "$W/mlp/run" --formats folded -- "$PY" -c \
        'import sys; sys.argv[0] = "train.py"; exec(compile(open("train.py").read(), "train.py", "exec"))' "$W/mlp/libmlp.so" --steps 200 &&
      "$PY" -m aiflame export "$W/mlp/run/profile.aiflame" --view stalls -f folded -o "$W/res/mlp-stalls.folded" &&
      "$PY" -m aiflame export "$W/mlp/run/profile.aiflame" --view stalls -f svg -o "$W/res/mlp-stalls.svg" \
        --opt "title=AI flame graph: MLP training step (CUDA, driven from Python)" \
        --opt "subtitle=real CUPTI PC samples on an NVIDIA $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" &&
      "$PY" -m aiflame export "$W/mlp/run/profile.aiflame" --view launches -f folded -o "$W/res/mlp-launches.folded"
      echo "mlp example exit $?" ) > "$W/res/mlp.log" 2>&1 &
    MLP=$!
    for v in cpu launches stalls combined; do
        timed "export $v folded" timeout 120 "$PY" -m aiflame export "$W/gpt/profile.aiflame" --view $v -f folded -o "$W/gpt/$v.folded" 2>&1 | tail -2
    done
    timed "export stalls svg" timeout 120 "$PY" -m aiflame export "$W/gpt/profile.aiflame" --view stalls -f svg -o "$W/gpt/stalls.svg" 2>&1 | tail -1
    timed "recover" timeout 120 "$PY" -m aiflame recover "$W/gpt/profile.aiflame" -o "$W/gpt/recovered.aiflame" 2>&1 | tail -2
    timed "export stalls of the recovered capture" timeout 120 "$PY" -m aiflame export "$W/gpt/recovered.aiflame" --view stalls -f folded -o "$W/gpt/rec-stalls.folded" 2>&1 | tail -1
    cmp "$W/gpt/stalls.folded" "$W/gpt/rec-stalls.folded" && echo "recovered capture: same stall view"
    "$PY" - "$W/gpt/stalls.folded" <<'PYEOF' | tee "$W/res/gpt_stall_check.txt"
import re, sys
from collections import Counter
tot = sass = src = mangled = 0
kern: Counter[str] = Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip("\n").rpartition(" ")
    f = stack.split(";")
    if "-" not in f: continue
    i = f.index("-"); n = int(n); tot += n
    k, s, ins = f[i + 1], f[i + 2], f[i + 3]
    kern[k] += n
    mangled += n * k.startswith("_Z")
    sass += n * bool(re.match(r"\+0x[0-9a-f]+ \S", ins))
    src += n * (not s.startswith("[unknown source]"))
print(f"stall samples {tot}; kernels {len(kern)}; with SASS {100*sass/max(tot,1):.1f}%; with source {100*src/max(tot,1):.1f}%; mangled-name samples {mangled}")
for k, n in kern.most_common(12): print(f"  {100*n/tot:5.1f}% {k[:110]}")
PYEOF
    cp "$W/gpt/stalls.folded" "$W/res/gpt-stalls.folded" 2>/dev/null; gzip -f "$W/res/gpt-stalls.folded" 2>/dev/null
    wait $MLP; cat "$W/res/mlp.log" | tail -5
fi
log "done; packing"
tar -C "$W/res" -czf "$OUTD/results.tgz" . && ls -l "$OUTD"
