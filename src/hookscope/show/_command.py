"""What every ``hookscope`` command shares when it ends: its exit status, documented in its
``--help``, and the one line it prints when something failed.

Exit status: 0 done; 1 the model failed (its forward or backward raised; the line names the
layer and its inputs); 2 a usage error (a bad option, model or input: the command's own usage
line and a hint; a model hookscope cannot hook, such as a TorchScript archive, too); 130
interrupted. ``nan`` uses 1 for its finding (a NaN or Inf), so a model
that raised there exits 3 (grep and diff keep 1 for "found" and 2 for trouble, the same way).
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import click

from ..errors import LayerNotFoundError, UnsupportedModelError, UsageError
from ._where import hint, locate

__all__ = ["EXITS", "GROUP_EXITS", "NAN_EXITS", "NAN_FAILED", "Group"]

EXIT_FAILED = 1  # the model failed; `nan` uses 1 for its finding and NAN_FAILED instead
NAN_FAILED = 3
INTERRUPTED = 130

EXITS = (
    "\b\nExit status:\n"
    "  0    done\n"
    "  1    the model failed: its forward or backward raised (the error names the\n"
    "       layer and its inputs)\n"
    "  2    usage error: a bad option, model or input\n"
    "  130  interrupted (Ctrl-C)"
)
GROUP_EXITS = (
    "\b\nExit status:\n"
    "  0    done\n"
    "  1    the model failed (the error names the layer and its inputs);\n"
    "       nan: a NaN or Inf was found\n"
    "  2    usage error: a bad option, model or input\n"
    "  3    nan only: the model failed\n"
    "  130  interrupted (Ctrl-C)"
)
NAN_EXITS = (
    "\b\nExit status:\n"
    "  0    no NaN or Inf in the forward or the backward\n"
    "  1    a NaN or Inf was found (its first producer is printed)\n"
    "  2    usage error: a bad option, model or input\n"
    "  3    the model failed otherwise (its forward or backward raised)\n"
    "  130  interrupted (Ctrl-C)"
)


class Command(click.Command):
    """Turns hookscope's usage errors into click's, shown with this command's usage line (exit
    2), Ctrl-C into exit 130, and other failures into one line on stderr naming the layer that
    raised (exit 1, or 3 for ``nan``), unless ``-v`` asked for tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            _traceback(ctx)
            click.echo("interrupted", err=True)
            sys.exit(INTERRUPTED)
        except (UsageError, LayerNotFoundError, UnsupportedModelError) as e:
            # a model hookscope cannot follow (TorchScript, replicas) is a bad model: usage
            _traceback(ctx)
            message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise click.UsageError(str(message), ctx) from None
        except Exception as e:
            if not _traceback(ctx):
                train = bool(ctx.meta.get("hookscope.train"))
                click.echo(_one_line(e, ctx.meta.get("hookscope.run"), train), err=True)
            sys.exit(ctx.meta.get("hookscope.failed", EXIT_FAILED))


def _traceback(ctx: click.Context) -> bool:
    verbose = bool((ctx.find_root().obj or {}).get("verbose"))
    if verbose:
        traceback.print_exc()
    return verbose


def _one_line(error: Exception, run: tuple[Any, Any] | None, train: bool = False) -> str:
    """``error: Type: first line of the message; the forward failed in 'layer' (Type) called
    with input=Tensor[...] dtype - hint (run with -v for the traceback)``; ``run``: the
    command's ``(model, inputs)``, run again (in training mode if ``train``, as ``nan``
    ran it) to find the layer."""
    first = str(error).splitlines()[0] if str(error) else ""
    text = f"error: {type(error).__name__}: {first}"
    failed = locate(*run, error, train=train) if run is not None else None
    if failed is not None:
        text += f"; the forward failed {failed}"
        if hint(failed):
            text += f" - {hint(failed)}"
    return text + " (run with -v for the traceback)"


class Group(click.Group):
    command_class = Command
