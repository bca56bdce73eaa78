"""One file per method; importing this package fills :data:`hookscope.explain.METHODS`."""

from .ablationcam import AblationCAM
from .cam import CAM
from .eigencam import EigenCAM
from .gradcam import GradCAM
from .gradcampp import GradCAMPlusPlus
from .hirescam import HiResCAM
from .layercam import LayerCAM
from .scorecam import ScoreCAM
from .xgradcam import XGradCAM

__all__ = [
    "CAM",
    "AblationCAM",
    "EigenCAM",
    "GradCAM",
    "GradCAMPlusPlus",
    "HiResCAM",
    "LayerCAM",
    "ScoreCAM",
    "XGradCAM",
]
