"""One file per method; importing this package fills :data:`hookscope.explain._base.METHODS`."""

from .cam import CAM
from .eigencam import EigenCAM
from .gradcam import GradCAM
from .gradcampp import GradCAMPlusPlus
from .hirescam import HiResCAM
from .layercam import LayerCAM
from .xgradcam import XGradCAM

__all__ = ["CAM", "EigenCAM", "GradCAM", "GradCAMPlusPlus", "HiResCAM", "LayerCAM", "XGradCAM"]
