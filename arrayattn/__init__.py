"""arrayattn: the reference library of attention mechanisms, on the Python array API.

Every variant is written once against the array API standard and runs on NumPy, CuPy,
PyTorch, JAX and array-api-strict arrays, returning an array of the caller's own
library, device and dtype.  See ``docs/conventions`` for the shared conventions.
"""
from .registry import Variant, attention_matrix, get_variant, register, variants
from .exact import softmax_attention
from .lsh import lsh_attention, lsh_buckets, lsh_rotations
from .luna import luna_attention
from .feature_maps import FeatureMap, get_feature_map, taylor_feature_map
from .kernel import (LinearAttentionState, efficient_attention, feature_attention,
                     feature_attention_step, linear_attention, linear_attention_state,
                     linear_attention_step)
from .linalg import pinv
from .nystrom import landmark_attention, nystrom_attention, segment_means
from .random_features import RandomFeatures, estimate_kernel, gerf_parameter, kernel_variance
from .performer import performer_attention
from .rfa import rfa_attention, rfa_features

__version__ = "0.1.0"

__all__ = [
    "Variant", "attention_matrix", "get_variant", "register", "variants",
    "softmax_attention",
    "lsh_attention", "lsh_buckets", "lsh_rotations",
    "luna_attention",
    "FeatureMap", "get_feature_map", "taylor_feature_map",
    "LinearAttentionState", "feature_attention", "feature_attention_step",
    "linear_attention", "linear_attention_state", "linear_attention_step",
    "efficient_attention",
    "pinv", "segment_means", "nystrom_attention", "landmark_attention",
    "RandomFeatures", "estimate_kernel", "gerf_parameter", "kernel_variance",
    "performer_attention", "rfa_attention", "rfa_features",
]
