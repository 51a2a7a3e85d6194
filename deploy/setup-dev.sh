#!/usr/bin/env bash
# Set up the development/CI environment: CRIU (deploy/install-criu.sh), a
# .venv with podsnap (editable) and its test dependencies, and the CRIU plugin. Idempotent: re-running with an unchanged
# pyproject.toml does nothing. torch comes from `pip install torch==2.13.0`,
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
# podsnap's CRIU plugin, built from source (rebuilt only when criu_plugin/podsnap_criu.c changes)
build_plugin() { $VENV/bin/python -m podsnap.criu_plugin.tools >/dev/null; }
# the snapshot agent's gRPC stubs, generated from snapshot/proto/*.proto (not committed; regenerated when they change)
gen_stubs() { $VENV/bin/python -m podsnap.snapshot.protogen >/dev/null; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x $VENV/bin/podsnap ]; then
  build_plugin
  gen_stubs
  exit 0
fi

echo "==> creating $VENV and installing podsnap[test]"
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
$VENV/bin/python -m pip install -q --upgrade pip setuptools wheel
# torch first, pinned, so nothing later resolves a CUDA build
$VENV/bin/python -m pip install -q torch==2.13.0
$VENV/bin/python -m pip install -q -e '.[test]'
build_plugin
gen_stubs
echo "$want" > "$STAMP"
echo "==> environment ready: $VENV"
