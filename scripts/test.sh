#!/usr/bin/env bash
# Installs hookscope with the dev extra into .venv, then runs ruff, mypy --strict and the
# whole test suite (slow and optional-dependency tests included).
source "$(dirname "$0")/_env.sh" dev
.venv/bin/ruff check src tests bench examples
.venv/bin/mypy
.venv/bin/python -m pytest -p no:cacheprovider "$@"
