"""Explain: the CAM family of attribution maps, batched, for CNNs and vision transformers."""

from ._base import METHODS, Explanation, LayerMethod, normalize
from ._input import GuidedBackprop, InputMethod, Saliency
from .methods import CAM, EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, XGradCAM

__all__ = [
    "CAM",
    "METHODS",
    "EigenCAM",
    "Explanation",
    "GradCAM",
    "GradCAMPlusPlus",
    "GuidedBackprop",
    "HiResCAM",
    "InputMethod",
    "LayerCAM",
    "LayerMethod",
    "Saliency",
    "XGradCAM",
    "normalize",
]
