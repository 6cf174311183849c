"""The conventions of FlashInfer's prefill and decode attention: single requests (ragged
``(tokens, heads, dim)`` tensors, ``NHD``/``HND`` key/value layouts) and batches over a paged
KV cache (``indptr`` / ``indices`` / ``last_page_len``); causal aligned bottom-right,
``window_left``, ``logits_soft_cap`` and an lse in base 2."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .base import draw_qkv, host
from .shipped import ShippedConvention, draw_pages, gather_dense

__all__ = ["FlashInferSinglePrefill", "FlashInferSingleDecode", "FlashInferBatchPrefill",
           "FlashInferBatchDecode", "batch_prefill_wrapper", "batch_decode_wrapper"]

#: The head dims FlashInfer's prebuilt kernels take.
HEAD_DIMS = (64, 128, 256)
LN2 = math.log(2.0)

_COMMON = {"kv_layout": (None, "HND"), "sm_scale": (None, 0.3),
           "window_left": (None, 1, 3, 1000), "logits_soft_cap": (None, 1.0, 50.0),
           "return_lse": (False, True)}


def _kwargs(case, *, causal: bool = True) -> dict:
    """FlashInfer's keyword arguments of a case."""
    o = case.opts
    kw = {"kv_layout": o.get("kv_layout") or "NHD", "sm_scale": o.get("sm_scale"),
          "window_left": int(o.get("window_left") or -1),
          "logits_soft_cap": o.get("logits_soft_cap"),
          "return_lse": bool(o.get("return_lse"))}
    if causal:
        kw["causal"] = bool(o.get("causal"))
    return kw


def _params(case) -> dict:
    """arrayattn's options of a case: causal bottom-right, ``window_left`` as
    ``window=(left, None)`` (bottom-right too), ``sm_scale``, the soft cap after the scale."""
    o = case.opts
    params = {}
    if o.get("causal"):
        params["causal"] = True
    if o.get("window_left"):
        params["window"] = (int(o["window_left"]), None)
    if o.get("sm_scale") is not None:
        params["scale"] = float(o["sm_scale"])
    if o.get("logits_soft_cap"):
        params["softcap"] = float(o["logits_soft_cap"])
    return params


def _natural_lse(lse):
    """FlashInfer's lse is ``log2(sum exp(logits))``: arrayattn's natural one is ``ln 2`` times
    it."""
    return lse * LN2


class _FlashInfer(ShippedConvention):
    head_dims = HEAD_DIMS
    equal_dims = True       # a paged cache holds k and v of one head dim


class FlashInferSinglePrefill(_FlashInfer):
    """``fn(q, k, v, causal=False, kv_layout="NHD", pos_encoding_mode="NONE",
    sm_scale=None, window_left=-1, logits_soft_cap=None, return_lse=False)``: FlashInfer's
    ``single_prefill_with_kv_cache``.

    q ``(qo_len, num_qo_heads, head_dim)``; k, v ``(kv_len, num_kv_heads, head_dim)``
    (``NHD``) or ``(num_kv_heads, kv_len, head_dim)`` (``HND``); the output is
    ``(qo_len, num_qo_heads, head_dim)``, the lse ``(qo_len, num_qo_heads)`` in base 2
    (FlashInfer's tests compare it with ``logsumexp / ln 2``).  ``causal`` aligns the last
    query with the last key (its docstring's ``tril(..., diagonal=kv_len - qo_len)``);
    ``window_left=w`` keeps keys ``j >= i + kv_len - qo_len - w``; the soft cap is
    ``cap * tanh(x * sm_scale / cap)`` (FlashInfer's ``test_logits_cap`` reference); GQA by
    fewer key/value heads.  No backward (FlashInfer's prefill is inference only), no
    ``pos_encoding_mode`` other than ``"NONE"``; head dims 64, 128, 256."""

    name = "flashinfer_single_prefill"
    signature = ("fn(q, k, v, causal=False, kv_layout='NHD', pos_encoding_mode='NONE', "
                 "sm_scale=None, window_left=-1, logits_soft_cap=None, return_lse=False) "
                 "-> out or (out, lse)")
    space = {"causal": (False, True), **_COMMON}

    def normalize(self, case):
        case = super().normalize(replace(case, b=1) if case.b != 1 else case)
        if case.opts.get("causal") and case.n > case.s:
            case = replace(case, n=case.s)   # bottom-right causal: no key for n - s rows
        return case

    def build_valid(self, case):
        rng = np.random.default_rng(case.seed)
        x = {name: a[0] for name, a in draw_qkv(case, rng).items()}     # (h, n, d)
        hnd = case.opts.get("kv_layout") == "HND"
        arrays = {"q": x["q"].swapaxes(0, 1).copy(), "do": x["do"]}
        for name in ("k", "v"):
            arrays[name] = x[name] if hnd else x[name].swapaxes(0, 1).copy()
        t = self.tensors(arrays, case)
        inputs = {"q": host(t["q"]).swapaxes(0, 1), "do": host(t["do"])}
        for name in ("k", "v"):
            inputs[name] = host(t[name]) if hnd else host(t[name]).swapaxes(0, 1)
        return self.judged_call(t, (), _params(case), inputs)

    def call_valid(self, fn, t, case):
        kw = _kwargs(case)
        res = fn(t["q"], t["k"], t["v"], pos_encoding_mode="NONE", **kw)
        out, lse = res if kw["return_lse"] else (res, None)
        return {"out": out.transpose(0, 1),
                "lse": None if lse is None else _natural_lse(lse.transpose(0, 1))}


class FlashInferSingleDecode(_FlashInfer):
    """``fn(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE", sm_scale=None,
    window_left=-1, logits_soft_cap=None, return_lse=False)``: FlashInfer's
    ``single_decode_with_kv_cache``, one query token: q ``(num_qo_heads, head_dim)``, k, v
    as for the single prefill, the output ``(num_qo_heads, head_dim)``, the lse
    ``(num_qo_heads,)`` in base 2; ``window_left=w`` keeps the last ``w + 1`` keys (its
    ``test_sliding_window``)."""

    name = "flashinfer_single_decode"
    signature = ("fn(q, k, v, kv_layout='NHD', pos_encoding_mode='NONE', sm_scale=None, "
                 "window_left=-1, logits_soft_cap=None, return_lse=False) "
                 "-> out or (out, lse)")
    space = dict(_COMMON)

    def normalize(self, case):
        return super().normalize(replace(case, b=1, n=1) if (case.b, case.n) != (1, 1)
                                 else case)

    build_valid = FlashInferSinglePrefill.build_valid

    def call_valid(self, fn, t, case):
        kw = _kwargs(case, causal=False)
        res = fn(t["q"][0], t["k"], t["v"], pos_encoding_mode="NONE", **kw)
        out, lse = res if kw["return_lse"] else (res, None)
        return {"out": out[:, None], "lse": None if lse is None else _natural_lse(lse[:, None])}


def _paged_case(case, rng, qo_lengths, kv_lengths, layout):
    """The arrays of a batch over a paged cache: q packed ``(total_q, h, d)``, the cache
    ``(max_num_pages, 2, page, h_kv, d)`` (``NHD``) or ``(max_num_pages, 2, h_kv, page, d)``
    (``HND``), the page tables; and the referee's dense packed k, v."""
    page = case.opts.get("page_size") or 16
    qkv = draw_qkv(replace(case, b=1, n=int(qo_lengths.sum())), rng)
    kp, vp, pages = draw_pages(rng, kv_lengths, page, case.hkv, case.d, case.dv)
    cache = np.stack([kp, vp], axis=1)                           # (P, 2, page, h_kv, d)
    if layout == "HND":
        cache = np.ascontiguousarray(cache.swapaxes(2, 3))
    arrays = {"q": qkv["q"][0].swapaxes(0, 1).copy(), "paged_kv_cache": cache,
              "do": qkv["do"][0]}
    ints = {"qo_indptr": np.concatenate([[0], np.cumsum(qo_lengths)]),
            "paged_kv_indptr": np.concatenate([[0], np.cumsum([len(p) for p in pages])]),
            "paged_kv_indices": np.concatenate(pages),
            "paged_kv_last_page_len": (np.asarray(kv_lengths) - 1) % page + 1}
    arrays.update({k: v.astype(np.int32) for k, v in ints.items()})
    return arrays, pages


def _paged_inputs(t, pages, qo_lengths, kv_lengths, layout) -> tuple[dict, dict]:
    """The referee's packed q, k, v, do (``(h, total, d)``) and segments, from the rounded
    tensors the kernel read."""
    cache = host(t["paged_kv_cache"])
    if layout == "HND":
        cache = cache.swapaxes(2, 3)
    inputs = {"q": host(t["q"]).swapaxes(0, 1), "do": host(t["do"]),
              "k": gather_dense(cache[:, 0], pages, kv_lengths),
              "v": gather_dense(cache[:, 1], pages, kv_lengths)}
    segments = {"cu_seqlens_q": np.concatenate([[0], np.cumsum(qo_lengths)]).astype(np.int64),
                "cu_seqlens_k": np.concatenate([[0], np.cumsum(kv_lengths)]).astype(np.int64)}
    return inputs, segments


class FlashInferBatchPrefill(_FlashInfer):
    """``fn(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
    paged_kv_last_page_len, *, causal=False, kv_layout="NHD", sm_scale=None,
    window_left=-1, logits_soft_cap=None, return_lse=False)``: FlashInfer's
    ``BatchPrefillWithPagedKVCacheWrapper`` as one function.  FlashInfer's API is
    ``plan(...)`` then ``run(q, paged_kv_cache, return_lse=...)``: pass a function that
    plans and runs (:func:`batch_prefill_wrapper` builds one).

    Request ``b`` holds queries ``q[qo_indptr[b]:qo_indptr[b+1]]`` (packed ``(total_q,
    num_qo_heads, head_dim)``) and ``kv_len_b`` keys in pages ``paged_kv_indices[
    paged_kv_indptr[b]:paged_kv_indptr[b+1]]`` of ``paged_kv_cache (max_num_pages, 2,
    page_size, num_kv_heads, head_dim)`` (``NHD``; ``HND``: ``(max_num_pages, 2,
    num_kv_heads, page_size, head_dim)``; index 0 the keys, 1 the values), the last page
    filled up to ``paged_kv_last_page_len[b]``.  Causal, ``window_left``, ALiBi-free
    logits as for :class:`FlashInferSinglePrefill`, per request (bottom-right); output
    ``(total_q, num_qo_heads, head_dim)``, lse ``(total_q, num_qo_heads)`` base 2.  Judged
    against arrayattn's packed ``softmax`` (``cu_seqlens``) on the keys gathered from the
    pages; the slots past a request's length hold finite garbage."""

    name = "flashinfer_batch_prefill"
    signature = ("fn(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices, "
                 "paged_kv_last_page_len, *, causal=False, kv_layout='NHD', sm_scale=None, "
                 "window_left=-1, logits_soft_cap=None, return_lse=False) -> out or "
                 "(out, lse)")
    space = {"causal": (False, True), "page_size": (None, 1, 5), **_COMMON}
    decode = False

    def _lengths(self, case, rng):
        lk = rng.integers(1, case.s + 1, case.b)
        lk[0] = case.s
        if self.decode:
            return np.ones(case.b, dtype=np.int64), lk
        lq = rng.integers(1, case.n + 1, case.b)
        lq[0] = case.n
        if case.opts.get("causal"):
            lk = np.maximum(lk, lq)      # bottom-right causal: every query sees a key
        return lq, lk

    def build_valid(self, case):
        rng = np.random.default_rng(case.seed)
        lq, lk = self._lengths(case, rng)
        layout = case.opts.get("kv_layout") or "NHD"
        arrays, pages = _paged_case(case, rng, lq, lk, layout)
        t = self.tensors(arrays, case)
        inputs, segments = _paged_inputs(t, pages, lq, lk, layout)
        return self.judged_call(t, (), {**_params(case), **segments}, inputs,
                                [f"kv lengths {lk.tolist()}, query lengths {lq.tolist()}"])

    def call_valid(self, fn, t, case):
        kw = _kwargs(case)
        res = fn(t["q"], t["paged_kv_cache"], t["qo_indptr"], t["paged_kv_indptr"],
                 t["paged_kv_indices"], t["paged_kv_last_page_len"], **kw)
        out, lse = res if kw["return_lse"] else (res, None)
        return {"out": out.transpose(0, 1),
                "lse": None if lse is None else _natural_lse(lse.transpose(0, 1))}


class FlashInferBatchDecode(FlashInferBatchPrefill):
    """``fn(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
    *, kv_layout="NHD", sm_scale=None, window_left=-1, logits_soft_cap=None,
    return_lse=False)``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` (``plan`` then
    ``run``) as one function (:func:`batch_decode_wrapper`); q ``(batch_size,
    num_qo_heads, head_dim)``, one token per request, the cache and page tables as for
    :class:`FlashInferBatchPrefill`; lse ``(batch_size, num_qo_heads)`` base 2."""

    name = "flashinfer_batch_decode"
    signature = ("fn(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices, "
                 "paged_kv_last_page_len, *, kv_layout='NHD', sm_scale=None, "
                 "window_left=-1, logits_soft_cap=None, return_lse=False) -> out or "
                 "(out, lse)")
    space = {"page_size": (None, 1, 5), **_COMMON}
    decode = True

    def normalize(self, case):
        return super().normalize(replace(case, n=1) if case.n != 1 else case)

    def call_valid(self, fn, t, case):
        kw = _kwargs(case, causal=False)
        res = fn(t["q"], t["paged_kv_cache"], t["paged_kv_indptr"], t["paged_kv_indices"],
                 t["paged_kv_last_page_len"], **kw)
        out, lse = res if kw["return_lse"] else (res, None)
        return {"out": out.transpose(0, 1),
                "lse": None if lse is None else _natural_lse(lse.transpose(0, 1))}


def _cache_dims(paged_kv_cache, kv_layout):
    """``(page_size, num_kv_heads)`` of a combined cache."""
    if kv_layout == "NHD":
        return paged_kv_cache.shape[2], paged_kv_cache.shape[3]
    return paged_kv_cache.shape[3], paged_kv_cache.shape[2]


def batch_prefill_wrapper(workspace_bytes: int = 128 << 20):
    """A function of :class:`FlashInferBatchPrefill`'s signature over FlashInfer's
    ``BatchPrefillWithPagedKVCacheWrapper`` (imports flashinfer when called; needs CUDA):
    it plans each call and runs it."""
    def batch_prefill(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                      paged_kv_last_page_len, *, causal=False, kv_layout="NHD",
                      sm_scale=None, window_left=-1, logits_soft_cap=None,
                      return_lse=False):
        import flashinfer
        import torch
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout)
        page, hkv = _cache_dims(paged_kv_cache, kv_layout)
        wrapper.plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                     q.shape[1], hkv, q.shape[2], page, causal=causal, sm_scale=sm_scale,
                     window_left=window_left, logits_soft_cap=logits_soft_cap,
                     q_data_type=q.dtype, kv_data_type=paged_kv_cache.dtype)
        return wrapper.run(q, paged_kv_cache, return_lse=return_lse)
    return batch_prefill


def batch_decode_wrapper(workspace_bytes: int = 128 << 20):
    """A function of :class:`FlashInferBatchDecode`'s signature over FlashInfer's
    ``BatchDecodeWithPagedKVCacheWrapper`` (imports flashinfer when called; needs CUDA)."""
    def batch_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices,
                     paged_kv_last_page_len, *, kv_layout="NHD", sm_scale=None,
                     window_left=-1, logits_soft_cap=None, return_lse=False):
        import flashinfer
        import torch
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout)
        page, hkv = _cache_dims(paged_kv_cache, kv_layout)
        wrapper.plan(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, q.shape[1],
                     hkv, q.shape[2], page, window_left=window_left,
                     logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                     q_data_type=q.dtype, kv_data_type=paged_kv_cache.dtype)
        return wrapper.run(q, paged_kv_cache, return_lse=return_lse)
    return batch_decode
