"""Optional dependencies: imported where used, with the exact install line when missing."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]

#: import name -> distribution name, where they differ
_PACKAGES = {"PIL": "pillow"}


def require(module: str, extra: str, *, purpose: str) -> ModuleType:
    """Import ``module`` or raise ImportError saying which hookscope extra provides it.

    Example: ``require("PIL.Image", "images", purpose="saving PNG files")``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        package = _PACKAGES.get(top, top)
        raise ImportError(
            f"{purpose} needs the optional package {package!r}, which is not installed: "
            f'pip install "hookscope[{extra}]" (the extras of the hookscope you installed), or '
            f"pip install {package}"
        ) from e
