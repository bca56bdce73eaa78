#!/usr/bin/env bash
# Packaging check (CI runs it after the tests): build the sdist and, from it, the wheel; check
# both (twine check --strict: metadata and the README as PyPI would render it; the wheel's
# contents); then install the wheel alone, with the pinned CPU torch and the cli extra, into a
# fresh virtual environment and run a smoke test from a folder outside the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || source scripts/_env.sh dev
.venv/bin/python -m pip install -q -c constraints.txt build twine
rm -rf dist
.venv/bin/python -m build --outdir dist . > /dev/null
.venv/bin/python -m twine check --strict dist/*
WHEEL=$(ls dist/hookscope-*.whl)
.venv/bin/python scripts/check_wheel.py "$WHEEL" dist/hookscope-*.tar.gz

FRESH=$(mktemp -d)
trap 'rm -rf "$FRESH"' EXIT
"$PY" -m venv "$FRESH/venv"
"$FRESH/venv/bin/python" -m pip install -q --upgrade pip
"$FRESH/venv/bin/python" -m pip install -q "torch==2.13.0"
"$FRESH/venv/bin/python" -m pip install -q -c "$ROOT/constraints.txt" "$WHEEL[cli]"
cd "$FRESH"  # nothing of the source tree is importable from here
cat > tiny.py <<'PY'
import torch.nn as nn


def build():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4, 2),
    )
PY
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$FRESH/venv/bin/python" - "$ROOT" <<'PY'
import sys
from pathlib import Path

import torch

import hookscope as hs

where = Path(hs.__file__).resolve()
assert Path(sys.argv[1]).resolve() not in where.parents, f"imported from the source tree: {where}"
assert (where.parent / "py.typed").is_file()
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
assert hs.summary(model, torch.randn(3, 8)).total_flops == 2 * 3 * (8 * 4 + 4 * 2)
print(f"hookscope {hs.__version__} from {where.parent}")
PY
H="$FRESH/venv/bin/hookscope"
"$H" --version
"$H" summary tiny.py:build --input-size 2,3,16,16 --depth 0 > /dev/null
"$H" cam tiny.py:build --input-size 2,3,16,16 --out maps > /dev/null
"$H" report tiny.py:build --input-size 2,3,16,16 --out report.html > /dev/null
test -s report.html && test -s maps/gradcam_0.png
set +e
"$H" nan tiny.py:build --input-size 2,3,16,16 > /dev/null; [ $? = 0 ] || { echo "nan: want 0"; exit 1; }
"$H" summary tiny.py:build 2> /dev/null; [ $? = 2 ] || { echo "usage error: want 2"; exit 1; }
set -e
echo "package check passed: $(basename "$WHEEL") and its sdist, installed alone outside the tree"
