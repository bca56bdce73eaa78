#!/usr/bin/env bash
# Installs hookscope with the hf extra into .venv and runs the quickstart on a real model.
source "$(dirname "$0")/_env.sh" hf
.venv/bin/python examples/quickstart.py
