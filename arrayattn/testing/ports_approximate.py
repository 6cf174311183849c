"""The profiles of approximate-attention ports: performer-pytorch, the two Nyströmformers,
fast-transformers and fla."""
from __future__ import annotations


import numpy as np

from ..core.xp import xp_namespace
from .records import Prepared, Profile, take_options

__all__ = ["PERFORMER_PYTORCH", "LUCIDRAINS_NYSTROM", "HF_NYSTROMFORMER", "FAST_TRANSFORMERS",
           "FLA", "prepare_performer_pytorch", "prepare_lucidrains_nystrom",
           "prepare_hf_nystromformer", "prepare_fast_transformers", "prepare_fla",
           "identity_features", "relu_plus", "conv_taps"]


def identity_features(x):
    """The identity feature map: the port's inputs already are the features."""
    return x


def relu_plus(epsilon: float):
    """performer-pytorch's generalized kernel ``relu(t) + kernel_epsilon`` as a callable
    ``kind`` of :func:`arrayattn.performer_attention` (array API)."""
    def kernel(t):
        return xp_namespace(t).maximum(t, 0.0) + epsilon
    kernel.__name__ = f"relu_plus_{epsilon:g}"
    return kernel


def prepare_performer_pytorch(q, k, v, params) -> Prepared:
    """performer-pytorch ``FastAttention`` (``softmax_kernel`` / ``generalized_kernel``)."""
    o = take_options(params, "performer_pytorch", {
        "projection_matrix": None, "causal": False, "generalized_attention": False,
        "kernel_epsilon": 1e-3, "eps": 1e-4, "causal_eps": 1e-6})
    if o["projection_matrix"] is None:
        raise ValueError("profile 'performer_pytorch' needs projection_matrix= (the "
                         "module's buffer FastAttention.projection_matrix, shape (m, d))")
    opts = {"omega": o["projection_matrix"], "causal": bool(o["causal"])}
    variant, notes = "performer_positive", []
    if o["generalized_attention"]:
        variant, opts["kind"] = "performer_relu", relu_plus(float(o["kernel_epsilon"]))
    elif o["eps"]:
        notes.append(
            f"performer-pytorch's softmax_kernel adds eps={o['eps']:g} to every "
            "feature after its max shift (performer_pytorch.py:108-113); "
            "performer_attention has no such option yet (docs/port-options.md "
            "'feature_eps'): a mismatch is expected. With eps=0 in the port it matches.")
    if o["causal"] and o["causal_eps"]:
        notes.append(
            f"performer-pytorch's causal path adds eps={o['causal_eps']:g} to every "
            "component of the key-feature prefix sums (performer_pytorch.py:188, "
            "208-210); no such option yet (docs/port-options.md 'key_sum_eps').")
    return Prepared(variant, q, k, v, opts, notes=notes)


def conv_taps(weight) -> np.ndarray:
    """A port's depthwise ``Conv2d(heads, heads, (K, 1), groups=heads)`` weight
    ``(heads, 1, K, 1)`` (or ``(heads, K)``) -> ``conv_kernel (heads, K)``."""
    w = np.asarray(weight)
    if w.ndim == 4:
        w = w[:, 0, :, 0]
    if w.ndim != 2:
        raise ValueError(f"conv weight must have shape (heads, 1, K, 1) or (heads, K); "
                         f"got {np.shape(weight)}")
    return w


def prepare_lucidrains_nystrom(q, k, v, params) -> Prepared:
    """lucidrains ``nystrom-attention`` ``NystromAttention`` (the attention core)."""
    o = take_options(params, "lucidrains_nystrom", {"num_landmarks": None,
                                                    "pinv_iterations": 6,
                                                    "res_conv_weight": None})
    m = o["num_landmarks"]
    if m is None:
        raise ValueError("profile 'lucidrains_nystrom' needs num_landmarks=")
    n, rows = q.shape[-2], None
    if n % m:
        # The port pads the sequence at the front with zero tokens (q = k = v = 0, no
        # bias in to_qkv) up to a multiple of m and returns the last n rows: the zero
        # keys stay in every softmax and in the landmark means.  Reproduced exactly.
        pad = m - n % m
        q, k, v = (np.concatenate([np.zeros((*x.shape[:-2], pad, x.shape[-1]), x.dtype), x],
                                  axis=-2) for x in (q, k, v))
        rows = slice(pad, None)
    opts = {"num_landmarks": int(m), "pinv_iters": int(o["pinv_iterations"]),
            "pinv_init": "global"}  # torch.max over the whole batch and all heads
    if o["res_conv_weight"] is not None:
        opts["conv_kernel"] = conv_taps(o["res_conv_weight"])
    return Prepared("nystrom_iterative", q, k, v, opts, rows=rows)


def prepare_hf_nystromformer(q, k, v, params) -> Prepared:
    """HF ``transformers`` ``NystromformerSelfAttention``."""
    o = take_options(params, "hf_nystromformer", {"num_landmarks": 64,
                                                  "segment_means_seq_len": None,
                                                  "conv_weight": None})
    m, n = int(o["num_landmarks"]), q.shape[-2]
    seq = n if o["segment_means_seq_len"] is None else int(o["segment_means_seq_len"])
    if seq != n or n % m:
        raise ValueError(f"HF Nystromformer reshapes the sequence into num_landmarks={m} "
                         f"segments of segment_means_seq_len // num_landmarks tokens: it needs "
                         f"n == segment_means_seq_len, a multiple of num_landmarks; got n={n}, "
                         f"segment_means_seq_len={seq}")
    opts = {"num_landmarks": m}
    if o["conv_weight"] is not None:
        opts["conv_kernel"] = conv_taps(o["conv_weight"])
    if m == n:  # HF computes exact softmax attention here (plus the conv)
        if "conv_kernel" not in opts:
            return Prepared("softmax", q, k, v, {})
        # softmax has no conv skip: Nystrom with every token a landmark and the SVD
        # pinv is softmax attention, with a tolerance from its (larger) float32 error
        return Prepared("nystrom_svd", q, k, v, {**opts, "pinv": "svd"})
    # HF's "original" Z0 = A^T / max colsum over the whole batch and all heads; the rows
    # of a softmax sum to 1, so that is the global ||A||_1 ||A||_inf init to rounding.
    return Prepared("nystrom_iterative", q, k, v,
                    {**opts, "pinv_iters": 6, "pinv_init": "global"})


def prepare_fast_transformers(q, k, v, params) -> Prepared:
    """fast-transformers ``LinearAttention`` / ``CausalLinearAttention`` (elu+1)."""
    o = take_options(params, "fast_transformers", {"causal": False, "eps": 1e-6})
    notes = [f"fast-transformers adds eps={o['eps']:g} to the denominator "
             "(linear_attention.py:75, causal_linear_attention.py:95); not reproduced "
             "(docs/port-options.md 'denominator_eps'); its relative effect is "
             "eps / denominator"] if o["eps"] else []
    return Prepared("linear_elu", q, k, v, {"causal": bool(o["causal"])}, notes=notes)


def prepare_fla(q, k, v, params) -> Prepared:
    """fla ``chunk_linear_attn`` / ``fused_chunk_linear_attn`` / ``naive_*_linear_attn``."""
    o = take_options(params, "fla", {"normalize": True, "scale": None, "eps": 1e-10})
    scale = q.shape[-1] ** -0.5 if o["scale"] is None else float(o["scale"])
    # fla's ops take the features: q, k are phi(q), phi(k) already (identity map)
    opts = {"feature_map": identity_features, "causal": True}
    if not o["normalize"]:
        # o_i = sum_{j<=i} (scale q_i . k_j) v_j: the scale moves onto q
        return Prepared("linear_elu", q * scale, k, v, {**opts, "normalize": False})
    # with normalize=True the scale cancels between numerator and denominator
    notes = [f"fla adds {o['eps']:g} to the scaled denominator (ops/linear_attn/utils.py:29, "
             "naive.py:39); not reproduced"] if o["eps"] else []
    return Prepared("linear_elu", q, k, v, opts, notes=notes)


PERFORMER_PYTORCH = Profile(
    "performer_pytorch", "performer-pytorch FastAttention", "bhnd",
    "projection_matrix (required), causal, generalized_attention, kernel_epsilon, "
    "eps (softmax_kernel, default 1e-4), causal_eps (default 1e-6)",
    "softmax_kernel adds eps = 1e-4 to the features after the max shift and the key "
    "shift is one max over all keys; the causal path adds 1e-6 to the key prefix "
    "sums: neither is reproduced yet (docs/port-options.md 'feature_eps', 'key_sum_eps'). "
    "The generalized kernel relu(w.x) + kernel_epsilon is reproduced exactly (a callable "
    "kind).", prepare_performer_pytorch)

LUCIDRAINS_NYSTROM = Profile(
    "lucidrains_nystrom", "nystrom-attention NystromAttention (attention core)", "bhnd",
    "num_landmarks (required), pinv_iterations, res_conv_weight",
    "front zero padding to a multiple of num_landmarks (reproduced: padded inputs, "
    "last n rows), pinv init as one max over batch and heads (pinv_init='global'), "
    "residual depthwise convolution of v (conv_kernel).", prepare_lucidrains_nystrom)

HF_NYSTROMFORMER = Profile(
    "hf_nystromformer", "transformers NystromformerSelfAttention", "bnhd",
    "num_landmarks, segment_means_seq_len, conv_weight",
    "pinv init Z0 = A^T / max colsum over batch and heads (pinv_init='global'); "
    "q and k each scaled by d^-1/4 (same logits); conv skip (conv_kernel); "
    "num_landmarks == seq_len is exact softmax (nystrom_svd with m = n). The "
    "additive attention_mask reaches only the third softmax (padding stays in "
    "the landmark means): not reproduced.", prepare_hf_nystromformer)

FAST_TRANSFORMERS = Profile(
    "fast_transformers", "pytorch-fast-transformers LinearAttention / "
    "CausalLinearAttention", "bnhd", "causal, eps (default 1e-6)",
    "elu+1 features; eps = 1e-6 added to the denominator (not reproduced; "
    "relative effect eps / denominator).", prepare_fast_transformers)

FLA = Profile(
    "fla", "flash-linear-attention chunk_linear_attn, fused_chunk_linear_attn, "
    "naive_recurrent_linear_attn, naive_chunk_linear_attn", "bnhd",
    "normalize (default True), scale, eps (default 1e-10)",
    "the ops take features (q, k after the feature map) and are causal; scale "
    "cancels when normalize=True; 1e-10 added to the denominator (not reproduced).",
    prepare_fla)
