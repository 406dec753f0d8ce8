# Sourced by scripts/main and scripts/test: picks a Python that has torch and triton 3.6.0,
# or builds .venv with the pinned versions (CPU machines: torch 2.13.0 CPU, numpy<2.4 for the
# Triton interpreter). Sets PY and PYTHONPATH.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
usable() {
    "$1" - <<'PY' 2>/dev/null
import sys, torch, triton, numpy, pytest
ok = triton.__version__ == "3.6.0" and sys.version_info >= (3, 10)
# the CPU path runs Triton's interpreter, which breaks with numpy 2.4
ok = ok and (torch.cuda.is_available() or tuple(map(int, numpy.__version__.split(".")[:2])) < (2, 4))
sys.exit(0 if ok else 1)
PY
}
if [ -n "${TILEPORT_PYTHON:-}" ]; then
    PY="$TILEPORT_PYTHON"
elif [ -x .venv/bin/python ] && usable .venv/bin/python; then
    PY=.venv/bin/python
elif usable python3; then
    PY=python3
else
    echo "== setting up .venv (torch 2.13.0, triton 3.6.0, numpy<2.4, pytest)" >&2
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv/bin/python -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4" "pytest>=8" "matplotlib>=3.8"
    .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
    PY=.venv/bin/python
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PY
