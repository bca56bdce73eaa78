"""Several ``hookscope`` commands run by one Python process, each seen as a shell sees a process
of its own: its stdout and its stderr, captured at file descriptors 1 and 2 (so what C++ code,
loggers and warnings write is caught too), and its exit status, as Python makes one from how
the command ended (``SystemExit``'s code; an escaping exception: its traceback and 1). Before
each command, torch's random state and the warning filters' memory of warnings already shown
are reset to a fresh process's.

A ``hookscope`` process spends most of its time importing torch (and transformers): tests that
read statuses and messages run their commands here, once per batch. What a process boundary
itself decides (Ctrl-C, the status a shell receives) keeps real processes of its own.

    python tests/cli_batch.py '[["names", "model.py:fn"], ...]'

prints a JSON list, a ``{"returncode": ..., "stdout": ..., "stderr": ...}`` per command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Sequence
from typing import Any


def run(
    *commands: Sequence[str], env: dict[str, str] | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """``hookscope <command>`` for each command, in order, in one child process with the
    environment ``env`` (default: this one's), Hugging Face offline."""
    env = {**(os.environ if env is None else env), "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_OFFLINE"] = "1"
    argv = json.dumps([list(c) for c in commands])
    done = subprocess.run(
        [sys.executable, __file__, argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    return [
        subprocess.CompletedProcess(["hookscope", *c], r["returncode"], r["stdout"], r["stderr"])
        for c, r in zip(commands, results, strict=True)
    ]


def _command(argv: list[str]) -> dict[str, Any]:
    """One command, its output captured at the file descriptors."""
    from hookscope.show import main  # inside the capture: the first command sees the import

    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            main(argv)
            code = 0
        except SystemExit as e:  # as Python's own exit turns it into a status
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
        out.seek(0)
        err.seek(0)
        return {"returncode": code, "stdout": out.read().decode(), "stderr": err.read().decode()}


def _main() -> None:
    import torch  # here, so that each command starts from a fresh process's random state

    seed, filters = torch.initial_seed(), list(warnings.filters)
    results = []
    for argv in json.loads(sys.argv[1]):
        torch.manual_seed(seed)
        warnings.resetwarnings()  # every warning may show again, once, as in a new process
        warnings.filters[:] = filters
        results.append(_command(argv))
    print(json.dumps(results))


if __name__ == "__main__":
    _main()
