#!/usr/bin/env bash
# Prepare this host for aiflame: Debian BCC, kernel headers for BCC, tracefs, and a .venv.
# Idempotent: each step checks first and says what it does (or that nothing was needed).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup] %s\n' "$*"; }
need_root() { [ "$(id -u)" = 0 ] || { echo "aiflame setup: must run as root (BPF needs it)" >&2; exit 1; }; }
need_root

# golang-github-google-pprof-dev: Google's own profile.proto, the schema the pprof tests read our files with.
APT_PKGS=(bpfcc-tools python3-bpfcc linux-headers-amd64 python3-venv python3-dev gcc g++ make binutils libze1 libze-dev systemtap-sdt-dev chromium linux-perf
          golang-github-google-pprof-dev)
missing=()
for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    say "Debian packages present: ${APT_PKGS[*]}"
fi

# BCC compiles against kernel headers; the running kernel ships none, Debian's 6.1 headers work
# (our BPF never reads kernel structs, so the version mismatch is harmless).
mod="/lib/modules/$(uname -r)"
if [ -e "$mod/build/include" ]; then
    say "kernel headers present at $mod/build"
else
    arch_dir=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1)
    common_dir=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -1)
    [ -n "$arch_dir" ] && [ -n "$common_dir" ] || { echo "aiflame setup: no headers under /usr/src" >&2; exit 1; }
    say "linking $mod/build -> $arch_dir and $mod/source -> $common_dir"
    mkdir -p "$mod"
    ln -sfn "$arch_dir" "$mod/build"
    ln -sfn "$common_dir" "$mod/source"
fi

# BCC needs tracefs to detach uprobes.
if [ -e /sys/kernel/tracing/uprobe_events ]; then
    say "tracefs mounted at /sys/kernel/tracing"
else
    say "mounting tracefs at /sys/kernel/tracing"
    mount -t tracefs nodev /sys/kernel/tracing
fi

# The venv comes from Debian's python3 so that the system's bcc module is importable.
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import bcc' 2>/dev/null; then
    say ".venv present and imports bcc"
else
    say "creating .venv from /usr/bin/python3 with system site packages (for bcc)"
    rm -rf .venv
    /usr/bin/python3 -m venv --system-site-packages .venv
fi
stamp=.venv/.aiflame-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
    say "project installed in .venv"
else
    say "installing aiflame with its dev, bench and accelerator-test dependencies (NVIDIA compiler, NCCL, CPU torch) into .venv"
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
    .venv/bin/python -m pip install -q -e '.[dev,bench,accel-test]'
    touch "$stamp"
fi
# Chakra's schema and codec (mlc-chakra) without its declared dependencies (HolisticTraceAnalysis -> jupyterlab,
# ~480 MB, none of it used by the schema): so it is not in pyproject's dependencies.
if .venv/bin/python -c 'import chakra.schema.protobuf.et_def_pb2' 2>/dev/null; then
    say "mlc-chakra present"
else
    say "installing mlc-chakra==1.0.0 (Chakra schema and encoder) without its dependencies"
    .venv/bin/python -m pip install -q --no-deps 'mlc-chakra==1.0.0'
fi
say "done"
