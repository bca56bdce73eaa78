# Shared by demo.sh and test.sh: make .venv with the pinned CPU torch, then hookscope with
# the extras named in $1. torch goes first, in its own step, and stays pinned by
# constraints.txt: an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[$1]"
if [ "$1" = dev ]; then
    # pytorch-grad-cam, a peer in the tests, requires torchvision, which must not be installed
    # here: install it alone (its other dependencies come with the dev extra).
    .venv/bin/python -m pip install -q -c constraints.txt --no-deps "grad-cam==1.5.7"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
