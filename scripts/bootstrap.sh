#!/usr/bin/env bash
# Create .venv with tpustream and its dev tools; a no-op when it is up to date.
# The first run downloads torch/torch_xla (about 7 GB, 1-2 minutes on a fast link).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.11 python3 python; do
    if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
  done
fi
"$python" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12), sys.version' 2>/dev/null || {
  echo "bootstrap: need Python 3.10-3.12 (torch_xla 2.9 wheels); set PYTHON=/path/to/python3.11" >&2
  exit 1
}

stamp=.venv/.tpustream-installed
wanted=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'
echo "$wanted" > "$stamp"
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'import torch, torch_xla; print("torch", torch.__version__, "torch_xla", torch_xla.__version__)'))"
