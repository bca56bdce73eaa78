"""W&B offline runs read back by W&B's own reader (``wandb leet inspect``): the oracle of the
W&B sink's tests and of the trainer callbacks' (their runs are W&B's, not hookscope's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_dir(root: Path) -> Path:
    """The one offline run under ``root`` (W&B's ``dir``)."""
    [found] = (root / "wandb").glob("offline-run-*")
    return found


def records(run: Path) -> list[dict[str, Any]]:
    """The run's transaction log."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    done = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def history(run: Path) -> list[dict[str, Any]]:
    """The run's logged rows, in order."""
    return [r["history"]["item"] for r in records(run) if r["type"] == "history"]
