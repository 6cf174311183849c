"""The catalogue: every registered variant, declared once, as data.

One table, :data:`VARIANTS`, holds the record of each variant -- its public function (whose
:class:`~arrayattn.core.pipeline.Spec` says how it runs: checks, reference form, engine, work
estimate, what each ``None`` option means), the uniform call where the function takes
other inputs, the default options, and the metadata the report, the tests and the docs
read (family, exactness, supported options, complexity, citation).  The registry
(:mod:`arrayattn.registry`) is built from this table, in this order, the first time it
is read: no variant is registered by importing a module.
"""
from __future__ import annotations

from ..exact.softmax import softmax_attention
from ..gated.draws import DELTA_DRAWS, GATED_DELTA_DRAWS, GLA_DRAWS, SSD_DRAWS
from ..gated.api import (default_gammas, delta_attention, delta_uniform, gated_delta_attention,
                         gated_delta_uniform, gla_attention, gla_uniform, retention,
                         ssd_attention, ssd_uniform)
from ..kernel.linear import efficient_attention, linear_attention
from ..lowrank.linformer import linformer_attention, uniform_call as linformer_uniform
from ..sparse.lsh import lsh_attention, uniform_call as lsh_uniform
from ..lowrank.luna import UNIFORM_PACKED, luna_attention, uniform_call as luna_uniform
from ..lowrank.nystrom import landmark_attention, nystrom_attention
from ..random_features.performer import performer_attention, uniform_call as performer_uniform
from ..sparse.pooling import pooling_attention
from .variant import Variant
from ..random_features.rfa import rfa_attention
from ..sparse import (bigbird_layout, fixed_layout, local_attention, longformer_layout,
                      sparse_attention, strided_layout)
from ..sparse.api import pattern_call

__all__ = ["VARIANTS"]

_KATHAROPOULOS = ("Katharopoulos et al. 2020, Transformers are RNNs: Fast Autoregressive "
                  "Transformers with Linear Attention")
_LINEAR_M = {"elu+1": "d", "relu": "d", "cosine": "d + 1", "taylor": "1 + d + d^2"}


def _linear(feature_map: str, extra: str = "") -> Variant:
    return Variant(
        name="linear_" + feature_map.replace("+1", ""), fn=linear_attention, family="kernel",
        exact=False, causal=True, key_mask=True, normalized=True,
        defaults={"feature_map": feature_map},
        complexity=(f"O((n + s) m dv) time, m = {_LINEAR_M[feature_map]}"
                    "; causal chunked O(n (m + dv) c)"),
        citation=_KATHAROPOULOS + extra,
        notes=("causal=True uses the chunked form (chunk_size=64); a row whose kernel "
               "sum is zero returns zeros"))


_PERFORMER_NOTES = (
    "omega= (an (m, d) matrix, e.g. a peer's projection loaded from an .npz file) replays "
    "that projection exactly via RandomFeatures.from_matrix; otherwise one is drawn from "
    "num_features, projection, norms and seed. One projection is shared by all batch "
    "elements and heads.")
_PERFORMER_CITATION = ("Choromanski et al. 2020, Rethinking Attention with Performers "
                       "(ICLR 2021)")


def _performer(kind: str, causal: bool, extra: str) -> Variant:
    return Variant(
        name=f"performer_{kind.replace('++', 'pp')}", fn=performer_attention,
        call=performer_uniform, family="random_features", exact=False, causal=causal,
        key_mask=True, normalized=True,
        defaults={"kind": kind, "num_features": 256, "projection": "orthogonal",
                  "norms": "chi", "seed": 0},
        parameter="num_features", random=True,
        complexity="O((n + s) m d) time, O((n + s) m) memory",
        citation=_PERFORMER_CITATION + ("; Likhosherstov et al. 2022, Chefs' Random Tables "
                                        "(NeurIPS 2022)" if kind == "favor++" else ""),
        notes=f"{extra} {_PERFORMER_NOTES}")


_GATED = dict(family="gated", exact=False, causal=True, key_mask=True, normalized=False,
              cross=False)
_DRAWN = ("drawn on the host with numpy.random.default_rng(seed), in q's dtype and on "
          "its device")


def _nystrom(pinv: str, citation: str, notes: str) -> Variant:
    # Neither record is ``normalized`` in the registry's sense (rows sum to 1 up to
    # 16 s eps): the iterative rows only to the pinv residual ||I - AZ||, the SVD rows
    # to ~eps * cond(A), and the landmark matrix of near-uniform attention has cond
    # 1e4-1e5.  tests/lowrank/test_nystrom.py checks both bounds.
    return Variant(
        name=f"nystrom_{pinv}", fn=nystrom_attention, family="low_rank", exact=False,
        causal=False, key_mask=True, normalized=False,
        defaults={"num_landmarks": 64, "pinv": pinv}, parameter="num_landmarks",
        complexity="O((n + s) m d + m^3) time, O((n + s) m) memory",
        citation=citation, notes=notes)


_SPARSE = dict(family="sparse", exact=False, causal=True, key_mask=True, normalized=True)
_CHILD = "Child et al. 2019, Generating Long Sequences with Sparse Transformers"

#: Every registered variant, in the order the report, the docs and the benchmarks list
#: them (family by family).
VARIANTS: tuple[Variant, ...] = (
    # -- exact ------------------------------------------------------------------------
    Variant(name="softmax", fn=softmax_attention, family="exact", exact=True, causal=True,
            key_mask=True, mask=True, normalized=True,
            complexity="O(n s d) time, O(n s) memory",
            citation="Vaswani et al. 2017, Attention Is All You Need"),
    Variant(name="softmax_blockwise", fn=softmax_attention, family="exact", exact=True,
            causal=True, key_mask=True, mask=True, normalized=True,
            defaults={"block_size": "auto"}, parameter="block_size",
            complexity="O(n s d) time, O((n + s) d + block^2) memory",
            citation="Dao et al. 2022, FlashAttention; Dao 2023, FlashAttention-2"),
    # -- kernel -----------------------------------------------------------------------
    _linear("elu+1"), _linear("relu"), _linear("cosine"),
    _linear("taylor", "; Zhang et al. 2024 (Hedgehog), Arora et al. 2024 (Based)"),
    Variant(name="efficient", fn=efficient_attention, family="kernel", exact=False,
            causal=False, key_mask=True, normalized=True,
            complexity="O((n + s) d dv) time and memory",
            citation="Shen et al. 2021, Efficient Attention: Attention with Linear "
                     "Complexities"),
    # -- random features --------------------------------------------------------------
    _performer("positive", True, "FAVOR+ positive features: unbiased, positive."),
    _performer("hyperbolic", True,
               "2m features [exp(wx), exp(-wx)]: unbiased, positive, lower variance."),
    _performer("trig", True,
               "2m sin/cos features: unbiased kernel but may be negative; the denominator "
               "can be near zero or negative on large-norm inputs."),
    _performer("favor++", False,
               "FAVOR++ (Likhosherstov et al. 2022, Chefs' Random Tables): GERF positive "
               "features with the variance-optimal A* of the inputs; unbiased, far lower "
               "error than FAVOR+ at large norms. Causal only with an explicit gerf_a= "
               "(A* depends on every key)."),
    _performer("relu", True,
               "Generalized kernel relu(w.x)/sqrt(m) (Performer paper sec. 2.4): not an "
               "estimate of softmax; projection='identity' gives relu(x) without "
               "projection."),
    Variant(name="rfa", fn=rfa_attention, family="random_features", exact=False,
            causal=True, key_mask=True, normalized=True,
            defaults={"num_features": 128, "sigma": 1.0, "seed": 0},
            parameter="num_features", random=True,
            complexity="O((n + s) m (d + dv)) time, O((n + s) m) memory; causal chunked "
                       "O(n m (c + dv))",
            citation="Peng et al. 2021, Random Feature Attention (ICLR 2021)",
            notes="Random Fourier (sin/cos) features of l2-normalised q, k at temperature "
                  "sigma (w = omega/sigma, omega iid N(0, I)); estimates softmax attention "
                  "of q/|q|, k/|k| with scale 1/sigma^2. Signed features: the denominator "
                  "may be near zero. The gated recurrence (gate=, causal only) takes the "
                  "caller's gate and is not part of the uniform call."),
    # -- gated linear -----------------------------------------------------------------
    Variant(name="retention", fn=retention, **_GATED, prepare=default_gammas,
            complexity="O(n c d + n d dv) time (chunks of c), O(n c + d dv) memory",
            citation="Sun et al. 2023, Retentive Network: A Successor to Transformer "
                     "for LLMs",
            notes="Unnormalised; RetNet's per-head decays 1 - 2^(-5-h) over axis -3."),
    Variant(name="gla", fn=gla_attention, call=gla_uniform, **_GATED, random=True,
            draws=GLA_DRAWS, defaults={"seed": 0},
            complexity="O(n c d + n d dv) time, O(n c d) memory (per-dimension pair "
                       "decays)",
            citation="Yang et al. 2024, Gated Linear Attention Transformers with "
                     "Hardware-Efficient Training",
            notes="Uniform call: gates log(sigmoid(N(3, 1))) per token and key dimension, "
                  + _DRAWN + "."),
    Variant(name="ssd", fn=ssd_attention, call=ssd_uniform, **_GATED, random=True,
            draws=SSD_DRAWS, defaults={"seed": 0},
            complexity="O(n c d + n d dv) time, O(n c + d dv) memory",
            citation="Dao & Gu 2024, Transformers are SSMs (Mamba-2)",
            notes="Uniform call: log decays -exp(N(-2.5, 0.5)) per token, " + _DRAWN + "."),
    Variant(name="deltanet", fn=delta_attention, call=delta_uniform, **_GATED, random=True,
            draws=DELTA_DRAWS, defaults={"seed": 0, "normalize_qk": True},
            complexity="O(n c d + n d dv + n c^2) time, O(n c + d dv) memory",
            citation="Schlag et al. 2021; Yang et al. 2024, Parallelizing Linear "
                     "Transformers with the Delta Rule over Sequence Length",
            notes="Uniform call: beta = sigmoid(N(0, 1)) per token, " + _DRAWN
                  + "; q and k L2-normalised."),
    Variant(name="gated_deltanet", fn=gated_delta_attention, call=gated_delta_uniform,
            **_GATED, random=True, draws=GATED_DELTA_DRAWS,
            defaults={"seed": 0, "normalize_qk": True},
            complexity="O(n c d + n d dv + n c^2) time, O(n c + d dv) memory",
            citation="Yang, Kautz & Hatamizadeh 2025, Gated Delta Networks: Improving "
                     "Mamba2 with Delta Rule",
            notes="Uniform call: beta = sigmoid(N(0, 1)) and log decays "
                  "log(sigmoid(N(3, 1))) per token, " + _DRAWN
                  + "; q and k L2-normalised."),
    # -- low rank ---------------------------------------------------------------------
    _nystrom("iterative",
             "Xiong et al. 2021, Nyströmformer (AAAI); pinv: Razavi et al. 2014",
             "6 iterations; rows sum to 1 only up to the pseudo-inverse residual "
             "||I - AZ||"),
    _nystrom("svd", "Xiong et al. 2021, Nyströmformer (AAAI)",
             "exact SVD pseudo-inverse (cutoff m*eps); equals exact attention when "
             "m = n = s; rows sum to 1 to ~eps * cond(landmark matrix)"),
    Variant(name="landmark", fn=landmark_attention, family="low_rank", exact=False,
            causal=False, key_mask=True, normalized=True,
            defaults={"num_landmarks": 64}, parameter="num_landmarks",
            complexity="O((n + s) m d) time, O((n + s) m) memory",
            citation="Xiong et al. 2021, Nyströmformer (AAAI), the two-softmax form"),
    Variant(name="linformer", fn=linformer_attention, call=linformer_uniform,
            family="low_rank", exact=False, causal=False, key_mask=True, normalized=False,
            defaults={"proj_dim": 32, "seed": 0}, parameter="proj_dim", random=True,
            complexity="O(n m d + m s d) time, O(n m + m d) memory",
            citation="Wang et al. 2020, Linformer: Self-Attention with Linear Complexity",
            notes="E, F (m, s) drawn N(0, 1/m) from seed (F = E) unless e=/f= are given; "
                  "host NumPy e/f are moved to q's library. Rows of A = softmax(Q(EK)^T) F "
                  "sum to 1 only if F's rows do. key_mask zeroes padded keys/values before "
                  "projection."),
    Variant(name="luna", fn=luna_attention, call=luna_uniform, family="low_rank",
            exact=False, causal=False, key_mask=True, normalized=True,
            defaults={"num_packed": UNIFORM_PACKED, "seed": 0}, parameter="num_packed",
            complexity="O((n + s) l d) time and memory",
            citation="Ma et al. 2021, Luna: Linear Unified Nested Attention",
            random=True, cross=True, linear_in_v=False,
            notes="the uniform call draws P (num_packed x d, iid N(0, 1), numpy "
                  "default_rng(seed)) and, when dv != d, an unpack key projection W_K "
                  "(dv x d, N(0, 1/dv)) from the same generator; the output is not linear "
                  "in v (the unpack keys are made from the packed values)"),
    # -- sparse -----------------------------------------------------------------------
    Variant(name="local", fn=local_attention, **_SPARSE,
            defaults={"window": 16, "block_size": 16}, parameter="window",
            complexity="O(n (2w + 2b) d) time and memory",
            citation="Child et al. 2019 (local heads); Beltagy et al. 2020 (sliding "
                     "window)",
            notes="window = keys on each side (FlashAttention window_size); end-aligned "
                  "when n != s."),
    Variant(name="longformer", fn=sparse_attention, call=pattern_call(longformer_layout),
            **_SPARSE, cross=False,
            defaults={"window": 8, "global_tokens": (0,), "block_size": 16},
            parameter="window", complexity="O(n (2w + 2b + g) d) time and memory",
            citation="Beltagy et al. 2020, Longformer: The Long-Document Transformer",
            notes="Layout built from n by longformer_layout(window=, global_tokens=, "
                  "block_size=)."),
    Variant(name="bigbird", fn=sparse_attention, call=pattern_call(bigbird_layout),
            **_SPARSE, cross=False, random=True,
            defaults={"block_size": 8, "num_window_blocks": 3, "num_global_blocks": 2,
                      "num_random_blocks": 2, "seed": 0},
            parameter="num_random_blocks",
            complexity="O(n (w + g + r) b d) time and memory",
            citation="Zaheer et al. 2020, Big Bird: Transformers for Longer Sequences",
            notes="Layout built from n by bigbird_layout(...); random blocks drawn on the "
                  "host."),
    Variant(name="strided", fn=sparse_attention,
            call=pattern_call(strided_layout, causal=False), **_SPARSE, cross=False,
            defaults={"stride": 8, "block_size": 32}, parameter="stride",
            complexity="O(n (l + n/l) b d) time and memory", citation=_CHILD,
            notes="Block-level strided pattern (strided_layout); symmetric unless "
                  "causal=True."),
    Variant(name="fixed", fn=sparse_attention,
            call=pattern_call(fixed_layout, causal=False), **_SPARSE, cross=False,
            defaults={"stride": 8, "summary": 1, "block_size": 32}, parameter="stride",
            complexity="O(n (l + c n/l) b d) time and memory", citation=_CHILD,
            notes="Block-level fixed pattern (fixed_layout); symmetric unless "
                  "causal=True."),
    Variant(name="poolingformer", fn=pooling_attention, family="sparse", exact=False,
            causal=True, key_mask=True, normalized=False,
            defaults={"window": 8, "pool_window": 32, "pool_size": 4, "pool": "mean",
                      "block_size": 16},
            parameter="pool_window",
            complexity="O(n (w1 + w2/stride + 2b) d) time and memory",
            citation="Zhang et al. 2021, Poolingformer: Long Document Modeling with "
                     "Pooling Attention",
            notes="Output = sliding-window attention + attention to mean-pooled "
                  "keys/values of a larger window (separately normalised, so rows of A sum "
                  "to 2). Level-2 projections are the caller's (q2=, k2=, v2=)."),
    # -- hashing ----------------------------------------------------------------------
    Variant(name="lsh", fn=lsh_attention, call=lsh_uniform, family="hashing", exact=False,
            causal=True, key_mask=True, normalized=True,
            defaults={"num_hashes": 4, "chunk_size": 64, "seed": 0},
            parameter="num_hashes",
            complexity="O(H n (log n + C d)) time, O(n d) memory (+ bounded score tiles)",
            citation="Kitaev, Kaiser & Levskaya 2020, Reformer: The Efficient Transformer",
            random=True, cross=False,
            notes="shared-QK attention: the uniform call uses q as qk and ignores k (keys "
                  "are the l2-normalised q); self-attention only (n = s); causal mode uses "
                  "a sliding window of chunk_size sorted slots so that no future token, not "
                  "even its bucket, changes a past output"),
)
