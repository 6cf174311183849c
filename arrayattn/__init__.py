"""arrayattn: the reference library of attention mechanisms, on the Python array API.

Every variant is written once against the array API standard and runs on NumPy, CuPy,
PyTorch, JAX and array-api-strict arrays, returning an array of the caller's own
library, device and dtype.  See ``docs/conventions`` for the shared conventions.
"""
from .registry.variant import Variant
from .registry import attention_matrix, get_variant, jit_uniform, register, variants
from .core.engine import use_engine
from ._numpy.workspace import release_workspace, set_workspace_limit
from . import reference
# The registry is built from arrayattn.registry.catalogue.VARIANTS (one table) when first read:
# importing these modules registers nothing.
from .exact.softmax import softmax_attention
from .exact.paged import paged_attention
from .kernel.feature_maps import FeatureMap, get_feature_map, taylor_feature_map
from .kernel.linear import (LinearAttentionState, efficient_attention, feature_attention,
                            feature_attention_step, linear_attention, linear_attention_state,
                            linear_attention_step)
from .random_features.estimates import (RandomFeatures, estimate_kernel, gerf_parameter,
                                        kernel_variance)
from .random_features.performer import performer_attention
from .random_features.rfa import rfa_attention, rfa_features
from .gated.api import (delta_attention, gated_attention_step, gated_delta_attention,
                        gla_attention, retention, retention_gammas, ssd_attention)
from .lowrank.pinv import pinv
from .lowrank.nystrom import landmark_attention, nystrom_attention, segment_means
from .lowrank.linformer import linformer_attention, linformer_projection
from .lowrank.luna import luna_attention
from .sparse import (BlockLayout, bigbird_layout, block_layout, fixed_layout, local_attention,
                     local_layout, longformer_layout, sparse_attention, strided_layout)
from .sparse.pooling import pooled_spans, pooling_attention
from .sparse.lsh import lsh_attention, lsh_buckets, lsh_rotations
from .backward import vjp

__version__ = "0.1.0"

#: Submodules loaded on first attribute access (``arrayattn.testing.assert_matches_reference``
#: works after a plain ``import arrayattn``; the import itself stays light).
_LAZY = ("testing", "report", "cli", "distributed")


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "Variant", "attention_matrix", "get_variant", "jit_uniform", "register", "variants",
    "use_engine", "release_workspace", "set_workspace_limit",
    "reference",
    "softmax_attention", "paged_attention",
    "FeatureMap", "get_feature_map", "taylor_feature_map",
    "LinearAttentionState", "feature_attention", "feature_attention_step",
    "linear_attention", "linear_attention_state", "linear_attention_step",
    "efficient_attention",
    "RandomFeatures", "estimate_kernel", "gerf_parameter", "kernel_variance",
    "performer_attention", "rfa_attention", "rfa_features",
    "retention", "retention_gammas", "gla_attention", "ssd_attention", "delta_attention",
    "gated_delta_attention", "gated_attention_step",
    "pinv", "segment_means", "nystrom_attention", "landmark_attention",
    "linformer_attention", "linformer_projection",
    "luna_attention",
    "BlockLayout", "block_layout", "local_layout", "strided_layout", "fixed_layout",
    "longformer_layout", "bigbird_layout", "sparse_attention", "local_attention",
    "pooling_attention", "pooled_spans",
    "lsh_attention", "lsh_buckets", "lsh_rotations",
    "vjp",
]
