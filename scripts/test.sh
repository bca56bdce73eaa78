#!/usr/bin/env bash
# Installs hookscope with the dev extra into .venv, then runs ruff, mypy --strict and the
# whole test suite (slow and optional-dependency tests included).
source "$(dirname "$0")/_env.sh" dev
# The HTML report is checked in a real browser: Debian's chromium (installed here when we may).
if ! command -v chromium > /dev/null && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    apt-get update -qq && apt-get install -y -qq chromium > /dev/null \
        || echo "could not install chromium: the report's browser test will be skipped" >&2
fi
if command -v chromium > /dev/null; then
    export HOOKSCOPE_REQUIRE_BROWSER=1  # the browser test fails rather than skips
fi
.venv/bin/ruff check src tests bench examples
.venv/bin/ruff format --check src tests bench examples
.venv/bin/mypy
# One worker per core (tests/conftest.py hands each worker whole files, the costliest first, so
# that no long file runs alone at the end); pass -n 0 to run in this process.
.venv/bin/python -m pytest -p no:cacheprovider -n auto "$@"
