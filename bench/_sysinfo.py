"""Process counters (page faults, steal, RSS) and the machine/version header."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import re
import resource
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MALLOC_VARS",
    "clear_peak_rss",
    "machine_info",
    "minor_faults",
    "rss_kib",
    "steal_ticks",
]

MALLOC_VARS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_ARENA_MAX",
)
_PACKAGES = ("torch", "transformers", "hookscope", "torchlens", "nnsight", "numpy", "psutil")


def minor_faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def steal_ticks() -> int:
    """Hypervisor steal ticks of the whole machine so far (0 where /proc/stat lacks them)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8])
    except (OSError, IndexError, ValueError):
        return 0


def rss_kib() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak RSS since the last reset) of this process, in KiB."""
    with open("/proc/self/status") as f:
        text = f.read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmRSS", "VmHWM")}  # type: ignore[union-attr]


def clear_peak_rss() -> None:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def hookscope_source() -> dict[str, str]:
    """Where the imported hookscope lives and a hash of its source (it may change between runs)."""
    import hookscope

    root = Path(hookscope.__file__).resolve().parent
    digest = hashlib.sha1()
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return {"path": str(root), "sha1": digest.hexdigest()[:12]}


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cuda_available": torch.cuda.is_available(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "versions": {p: _version(p) for p in _PACKAGES},
        "hookscope_source": hookscope_source(),
        "malloc_env": {k: os.environ[k] for k in MALLOC_VARS if k in os.environ},
    }
