"""Explain: attribution maps, batched, for CNNs, vision transformers, text and 1-D signals:
the CAM family, input-space gradients, Captum's path and perturbation methods (integrated
gradients, layer conductance, occlusion, feature ablation) and transformer attention maps
(rollout, gradient-weighted relevance) from fused attention, and activation patching over
a grid of layers x positions (:func:`patching`, :func:`attribution_patching`), the logit
lens (:func:`logit_lens`) and direct logit attribution (:func:`logit_attribution`).

Every method is listed in :data:`METHODS` (a :class:`MethodInfo` each). A new CAM method is
one file in ``methods/``: a :class:`LayerMethod` subclass whose ``combine(ctx)`` turns a
:class:`Context` (activations, gradients, targets) into maps, and a ``register(MethodInfo(...))``
call; an attention map is an :class:`AttentionMethod` whose ``combine`` turns the layers'
attention weights (and gradients) into a token-by-token matrix. Faithfulness metrics live in
``hookscope.explain.metrics``.
"""

from . import metrics
from ._ablation import Ablation
from ._base import Context, Explanation, LayerMethod, normalize
from ._combined import GuidedGradCAM, SmoothGrad
from ._input import GuidedBackprop, InputMethod, Saliency
from ._lens import Lens, logit_lens
from ._logit_attribution import LogitAttribution, logit_attribution
from ._overlay import overlay
from ._patching import Patching, attribution_patching, patching
from ._perturb import Perturbation
from ._registry import METHODS, MethodInfo
from ._targets import scores as target_scores
from ._transformer import AttentionMethod
from .methods import (
    CAM,
    AblationCAM,
    AttentionRollout,
    EigenCAM,
    FeatureAblation,
    GradCAM,
    GradCAMPlusPlus,
    HiResCAM,
    InputXGradient,
    IntegratedGradients,
    LayerCAM,
    LayerConductance,
    LayerIntegratedGradients,
    Occlusion,
    ScoreCAM,
    TransformerRelevance,
    XGradCAM,
)

__all__ = [
    "CAM",
    "METHODS",
    "Ablation",
    "AblationCAM",
    "AttentionMethod",
    "AttentionRollout",
    "Context",
    "EigenCAM",
    "Explanation",
    "FeatureAblation",
    "GradCAM",
    "GradCAMPlusPlus",
    "GuidedBackprop",
    "GuidedGradCAM",
    "HiResCAM",
    "InputMethod",
    "InputXGradient",
    "IntegratedGradients",
    "LayerCAM",
    "LayerConductance",
    "LayerIntegratedGradients",
    "LayerMethod",
    "Lens",
    "LogitAttribution",
    "MethodInfo",
    "Occlusion",
    "Patching",
    "Perturbation",
    "Saliency",
    "ScoreCAM",
    "SmoothGrad",
    "TransformerRelevance",
    "XGradCAM",
    "attribution_patching",
    "logit_attribution",
    "logit_lens",
    "metrics",
    "normalize",
    "overlay",
    "patching",
    "target_scores",
]
