"""Study a model's depth behaviour: depth weights, per-layer magnitudes and gradient norms, and their plots."""

from attnres.analysis.profile import DepthProfile, depth_profile, depth_weight_matrix, layer_grad_norms

__all__ = ["DepthProfile", "depth_profile", "depth_weight_matrix", "layer_grad_norms"]
