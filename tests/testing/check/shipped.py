"""The plain forms the conventions' authors ship, as kernels of the checker's conventions
(issue #48's conformance suite): FlashAttention's ``attention_ref`` semantics written here
from its documentation (``tests/test_util.py``: dense and varlen, ``upcast`` both ways,
``reorder_ops``, ALiBi as ``attn_bias_from_alibi_slopes`` forms it -- causal:
``slope (j - s + 1)``), Hugging Face's attention functions (eager, sdpa, flex) behind the
``sdpa`` signature, torch SDPA under one backend, and fla's naive references loaded
without Triton.  Each computes the formula its authors ship, rounded as they round it: a
correct checker never flags one."""
from __future__ import annotations

import importlib
import importlib.util
import math
import os

import torch


# -- FlashAttention's attention_ref ---------------------------------------------------------

def _local_mask(n, s, window):
    """FlashAttention's ``construct_local_mask``: True where a key is hidden."""
    row = torch.arange(n)[:, None]
    col = torch.arange(s)[None, :]
    left, right = window
    if left < 0:
        return col > row + s - n + right
    return (col > torch.clamp(row + s - n + right, max=s)) | (col < row + s - n - left)


def _alibi_bias(slopes, n, s, causal):
    """``attn_bias_from_alibi_slopes``: causal ``slope (j - s + 1)``, else ``-slope |i + s
    - n - j|`` (float32, ``(b or 1, h, n or 1, s)``)."""
    slopes = slopes.float()
    slopes = slopes.reshape(1, -1, 1, 1) if slopes.ndim == 1 else slopes[:, :, None, None]
    if causal:
        return torch.arange(-s + 1, 1, dtype=torch.float32) * slopes
    row = torch.arange(n)[:, None]
    col = torch.arange(s)[None, :]
    return -slopes * (row + s - n - col).abs().float()


def attention_ref(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                  window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  deterministic=False, return_attn_probs=False, *, upcast=True,
                  reorder_ops=False):
    """``flash_attn_func``'s signature around ``attention_ref`` (``(b, n, h, d)``)."""
    if return_attn_probs:
        raise NotImplementedError("attention_ref returns no log-sum-exp")
    if causal:
        window_size = (window_size[0], 0)
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    n, s, d = q.shape[1], k.shape[1], q.shape[-1]
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    if not reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q * scale, k)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q, k * scale)
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    local = None
    if window_size[0] >= 0 or window_size[1] >= 0:
        local = _local_mask(n, s, window_size)
        scores = scores.masked_fill(local, float("-inf"))
    if alibi_slopes is not None:
        scores = scores + _alibi_bias(alibi_slopes, n, s, causal)
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    if local is not None:   # rows without a key: zeros, not NaN
        attention = attention.masked_fill(local.all(dim=-1, keepdim=True), 0.0)
    return torch.einsum("bhts,bshd->bthd", attention, v).to(dtype)


def attention_ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         dropout_p=0.0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         deterministic=False, return_attn_probs=False, **kw):
    """``flash_attn_varlen_func``'s signature: ``attention_ref`` per packed sequence, as
    FlashAttention's tests pad and unpad them."""
    outs = []
    for b in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]][None]
        ks = k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]][None]
        vs = v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]][None]
        slopes = None if alibi_slopes is None else (
            alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b:b + 1])
        if ks.shape[1] == 0:
            outs.append(torch.zeros(qs.shape[:-1] + (v.shape[-1],), dtype=q.dtype))
            continue
        outs.append(attention_ref(qs, ks, vs, dropout_p, softmax_scale, causal, window_size,
                                  softcap, slopes, deterministic, return_attn_probs, **kw))
    return torch.cat(outs, dim=1)[0]


def with_options(fn, **options):
    """``fn`` with keyword options fixed (``upcast=False`` ...), named for the reports."""
    def kernel(*args, **kwargs):
        return fn(*args, **kwargs, **options)
    kernel.__name__ = fn.__name__ + "".join(f"[{k}={v}]" for k, v in options.items())
    return kernel


# -- Hugging Face's attention functions behind the sdpa signature -----------------------------

class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.training = groups, False, False


def hf_attention(name):
    """``sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)`` calling
    Hugging Face's ``eager`` (llama's ``eager_attention_forward``), ``sdpa`` or ``flex``
    attention function, its mask as HF builds it (additive, the dtype's minimum where a
    key is hidden; top-left causal)."""
    if name == "eager":
        fn = importlib.import_module(
            "transformers.models.llama.modeling_llama").eager_attention_forward
    elif name == "sdpa":
        fn = importlib.import_module(
            "transformers.integrations.sdpa_attention").sdpa_attention_forward
    else:
        fn = importlib.import_module(
            "transformers.integrations.flex_attention").flex_attention_forward

    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        n, s = q.shape[-2], k.shape[-2]
        visible = None
        if is_causal:
            visible = torch.ones(n, s, dtype=torch.bool).tril()
        elif attn_mask is not None and attn_mask.dtype == torch.bool:
            visible = attn_mask
        if visible is not None and not bool(visible.any(-1).all()):
            raise NotImplementedError("HF's attention gives a row without keys the mean of v")
        mask = None
        if visible is not None:
            low = torch.finfo(q.dtype).min
            mask = torch.zeros(n, s, dtype=q.dtype).masked_fill(~visible, low)[None, None]
        elif attn_mask is not None:
            mask = attn_mask.to(q.dtype)[None, None]
        if name == "flex" and mask is not None:
            raise NotImplementedError("HF's flex function takes a BlockMask")
        module = _Module(q.shape[-3] // k.shape[-3])
        scaling = scale if scale is not None else q.shape[-1] ** -0.5
        out = fn(module, q, k, v, mask, scaling=scaling, dropout=0.0)[0]
        return out.transpose(1, 2)
    kernel.__name__ = f"hf_{name}_attention"
    return kernel


def sdpa_backend(backend):
    """torch's SDPA under one backend (``"math"``, ``"flash"``: the CPU flash kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        with sdpa_kernel([which]):
            try:
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    scale=scale, enable_gqa=enable_gqa)
            except RuntimeError as exc:   # "No available kernel": the backend's limits
                raise NotImplementedError(str(exc).splitlines()[0]) from None
    kernel.__name__ = f"sdpa_{backend}"
    return kernel


# -- fla's naive references --------------------------------------------------------------------

def fla_naive(op: str):
    """``fla.ops.<op>.naive`` loaded without fla's package ``__init__`` (which needs
    Triton)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla-core is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", op, "naive.py")
    loader = importlib.util.spec_from_file_location(f"_fla_{op}_naive", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def fla_simple_gla_refs():
    """``{name: kernel}`` of fla's simple-GLA references in its ``chunk_simple_gla``
    signature (the chunk form in chunks of 16 and 64, the recurrence)."""
    naive = fla_naive("simple_gla")

    def chunk(size):
        def kernel(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
            init = None if initial_state is None else initial_state.float()
            o, state = naive.naive_chunk_simple_gla(q, k, v, g, init, output_final_state,
                                                    chunk_size=size, scale=scale)
            return o.to(q.dtype), state
        kernel.__name__ = f"naive_chunk_simple_gla[{size}]"
        return kernel

    def recurrent(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
        init = None if initial_state is None else initial_state.float()
        return naive.naive_recurrent_simple_gla(q, k, v, g, scale, init, output_final_state)
    recurrent.__name__ = "naive_recurrent_simple_gla"
    return {"chunk16": chunk(16), "chunk64": chunk(64), "recurrent": recurrent}


def fla_gla_recurrent():
    """fla's ``naive_recurrent_gla`` in ``chunk_gla``'s signature (its scale is fixed at
    ``K ** -0.5``: another scale is unsupported)."""
    naive = fla_naive("gla")

    def kernel(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
        if scale is not None and scale != q.shape[-1] ** -0.5:
            raise NotImplementedError("naive_recurrent_gla has no scale argument")
        init = None if initial_state is None else initial_state.float()
        o, state = naive.naive_recurrent_gla(q, k, v, g, init, output_final_state)
        return o.to(q.dtype), state
    kernel.__name__ = "naive_recurrent_gla"
    return kernel
