"""One file per method; importing this package fills :data:`hookscope.explain.METHODS`."""

from .ablationcam import AblationCAM
from .attention_rollout import AttentionRollout
from .cam import CAM
from .eigencam import EigenCAM
from .feature_ablation import FeatureAblation
from .gradcam import GradCAM
from .gradcampp import GradCAMPlusPlus
from .hirescam import HiResCAM
from .input_x_gradient import InputXGradient
from .integrated_gradients import IntegratedGradients
from .layer_conductance import LayerConductance
from .layer_integrated_gradients import LayerIntegratedGradients
from .layercam import LayerCAM
from .occlusion import Occlusion
from .scorecam import ScoreCAM
from .transformer_relevance import TransformerRelevance
from .xgradcam import XGradCAM

__all__ = [
    "CAM",
    "AblationCAM",
    "AttentionRollout",
    "EigenCAM",
    "FeatureAblation",
    "GradCAM",
    "GradCAMPlusPlus",
    "HiResCAM",
    "InputXGradient",
    "IntegratedGradients",
    "LayerCAM",
    "LayerConductance",
    "LayerIntegratedGradients",
    "Occlusion",
    "ScoreCAM",
    "TransformerRelevance",
    "XGradCAM",
]
