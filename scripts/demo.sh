#!/usr/bin/env bash
# Installs hookscope with the cli extra into .venv, then runs `hookscope demo`: a small CNN is
# trained on synthetic shapes (no download) and its HTML report is written to hookscope-demo/.
# Arguments go to the demo (e.g. --quick, --out DIR).
source "$(dirname "$0")/_env.sh" cli
.venv/bin/hookscope demo "$@"
