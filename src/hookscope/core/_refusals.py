"""What sessions refuse, and the messages that say why: models whose calls cannot be followed
(TorchScript, ``nn.DataParallel`` replicas, a copy of a hooked module) and calls inside a
``torch.func`` transform. The policy itself is ``_session``'s; the table is
``docs/guarantees.md``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ._compile import transforms_now

__all__ = ["check_model", "replica_error", "scripted_error", "transformed_error"]


_TRANSFORM_FIX = {
    "vmap": "for vmap, call the model on the whole batch (vmap's result equals it for a "
    "model whose samples do not interact)",
    "grad": "for grad, vjp and jacrev, run a plain forward and take gradients with "
    "autograd (loss.backward(), torch.autograd.grad or torch.autograd.functional.jacobian)",
    "jvp": "for jvp and jacfwd, torch.autograd.functional.jvp and .jacobian compute the "
    "same with a plain forward",
    "functionalize": "for functionalize, run the model itself",
}


def transformed_error(layer: str, entry: str) -> UnsupportedModelError:
    """``layer`` ran inside a torch.func transform, where ``entry`` cannot work."""
    kinds, where = transforms_now()
    fixes = "; ".join(_TRANSFORM_FIX.get(k, f"for {k}, run the model itself") for k in kinds)
    return UnsupportedModelError(
        f"{layer or 'the model'!r} ran inside {where} (a torch.func transform), where tensors "
        "are the transform's wrappers (one sample's slice under vmap, dual or gradient-tracking "
        f"tensors under jvp and grad) that mean nothing outside it: {entry} cannot use them. "
        "Fix: run the model outside "
        f"the transform while {entry} is open ({fixes}), or, where the model's own forward "
        "runs the transform, select layers outside it. (torch.func.functional_call is not a "
        "transform and works; hs.edit works inside transforms.)"
    )


def check_model(model: nn.Module, root: nn.Module) -> None:
    """Refuse models whose calls cannot be followed: TorchScript, DataParallel replicas."""
    if isinstance(root, torch.jit.ScriptModule):
        raise scripted_error("the model", root)
    module: nn.Module | None = model
    while module is not None:
        if isinstance(module, nn.DataParallel) and len(module.device_ids or []) > 1:
            raise UnsupportedModelError(
                f"nn.DataParallel over {len(module.device_ids)} devices runs a copy of the "
                "model per device, in threads; hookscope cannot attribute their calls "
                "reliably. Hook the model on one device (model.module, or DataParallel with "
                "device_ids=[0]), or use DistributedDataParallel (one process per GPU)."
            )
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        module = inner if isinstance(inner, nn.Module) else None


def replica_error(module: nn.Module) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"a hook of hookscope ran on a copy of the hooked {type(module).__name__} (a "
        "DataParallel replica, or a copy made while the hooks existed); hookscope records "
        "only the modules it hooked. Hook the model on one device."
    )


def scripted_error(what: str, module: nn.Module) -> UnsupportedModelError:
    kind = getattr(module, "original_name", type(module).__name__)
    return UnsupportedModelError(
        f"{what} ({kind}) is TorchScript (torch.jit.script / trace) or part of a TorchScript "
        "module: PyTorch runs it in C++ and does not allow Python hooks on it or inside it. "
        "Hook the Python model before scripting it (or export it with torch.export instead)."
    )
