#!/usr/bin/env bash
# Creates .venv with recfuse and everything its tests and benchmark need, on a fresh machine.
# CPU machine: torch==2.13.0 (CPU build from local disk), torchrec 1.8.0 + fbgemm-gpu-cpu 1.8.0.
# A machine that already has a CUDA torch: keeps it (venv with --system-site-packages) and pairs
# torchrec/fbgemm-gpu with that torch's version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  if "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    "$PY" -m venv --system-site-packages "$VENV"
  else
    "$PY" -m venv "$VENV"
  fi
fi
P="$VENV/bin/python"
"$P" -m pip install -q --upgrade pip
if ! "$P" -c 'import torch' 2>/dev/null; then
  # The pin matters: a bare `torch` pulls a multi-GB CUDA build onto a CPU machine.
  "$P" -m pip install -q torch==2.13.0 numpy
fi
TORCH_MINOR=$("$P" -c 'import torch; print(".".join(torch.__version__.split("+")[0].split(".")[:2]))')
HAS_CUDA=$("$P" -c 'import torch; print(int(torch.cuda.is_available()))')
case "$TORCH_MINOR" in
  2.13) TR=1.8.0; FB=1.8.0 ;;
  2.12) TR=1.7.0; FB=1.7.0 ;;
  2.11) TR=1.6.0; FB=1.6.0 ;;
  *) TR=""; FB="" ;;
esac
"$P" -m pip install -q "triton>=3.2" pytest hypothesis numpy tqdm matplotlib nbclient nbformat ipykernel
if [ -n "$TR" ] && [ "${RECFUSE_SKIP_TORCHREC:-0}" != 1 ]; then
  if ! "$P" -c 'import torchrec' 2>/dev/null; then
    # torchrec's own requirement on fbgemm-gpu would pull the 2.7 GB CUDA wheel: install its small
    # deps by hand and torchrec itself with --no-deps.
    if [ "$HAS_CUDA" = 1 ]; then FBPKG=fbgemm-gpu; else FBPKG=fbgemm-gpu-cpu; fi
    "$P" -m pip install -q tensordict "torchmetrics==1.0.3" pyre-extensions iopath
    "$P" -m pip install -q --no-deps "$FBPKG==$FB" "torchrec==$TR"
  fi
fi
"$P" -m pip install -q --no-deps -e .
"$P" - <<'PY'
import torch, importlib
msg = [f"torch {torch.__version__}"]
for name in ("triton", "torchrec", "fbgemm_gpu"):
    try:
        m = importlib.import_module(name)
        msg.append(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - report, do not fail: torchrec is optional
        msg.append(f"{name} unavailable ({type(e).__name__})")
print("recfuse env:", ", ".join(msg))
PY
