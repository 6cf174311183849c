"""Second tries that explain a mismatch: the output matches under another layout, with the
output's axes swapped, or with top-left causal alignment."""
from __future__ import annotations

import numpy as np

from .outputs import compare_to_reference
from .profiles import get_profile

__all__ = ["top_left_hint", "layout_hint"]

_WORDS = {"bhnd": "(batch, heads, tokens, dim)", "bnhd": "(batch, tokens, heads, dim)"}


def top_left_hint(c, arrays: dict, params: dict, rtol, layout, profile) -> str:
    """A causal mismatch with ``n != s`` that matches with top-left alignment (torch
    SDPA's ``is_causal``: query ``i`` sees keys ``j <= i``) says so; else ``""``."""
    q, k = arrays["q"], arrays["k"]
    n, s = (q.shape[-3], k.shape[-3]) if layout == "bnhd" else (q.shape[-2], k.shape[-2])
    if profile is not None or params.get("causal") is not True or n == s or "mask" in params:
        return ""
    top_left = np.arange(s)[None, :] <= np.arange(n)[:, None]
    try:
        alt = compare_to_reference(arrays["out"], c.variant, q, k, arrays["v"], rtol=rtol,
                                   layout=layout, **{**params, "causal": False,
                                                     "mask": top_left})
    except Exception:  # the variant takes no mask: no hint
        return ""
    if not alt.ok:
        return ""
    return ("hint: this output MATCHES with top-left causal alignment (query i sees keys "
            "j <= i, as torch SDPA's is_causal); arrayattn aligns causal masks at the end "
            "(j <= i + s - n, as FlashAttention-2). Validate with --profile sdpa, or pass "
            "the top-left mask in the .npz as mask=")


def layout_hint(rec, arrays: dict, params: dict, rtol, layout, profile) -> str:
    """A mismatch (or an ``out`` of the wrong shape) that matches with the tokens and heads
    axes swapped -- in all four arrays (the other ``--layout``) or in ``out`` alone --
    says so; else ``""``."""
    q, k, v, o = (arrays[name] for name in ("q", "k", "v", "out"))
    if min(a.ndim for a in (q, k, v, o)) < 3:
        return ""
    axes = "axes 1 and 2" if o.ndim == 4 else "axes -3 and -2"
    cur = layout or (get_profile(profile).layout if profile is not None else "bhnd")
    other = "bnhd" if cur == "bhnd" else "bhnd"
    tries = (
        (other, o, f"hint: the output matches with {axes} swapped in q, k, v and out: "
                   f"pass --layout {other} (arrays as {_WORDS[other]})"),
        (cur, np.swapaxes(o, -3, -2),
         f"hint: out matches with its {axes} swapped: q, k, v are read as {_WORDS[cur]} "
         f"but out is {_WORDS[other]}; save out with those axes swapped (torch: "
         "out.transpose(1, 2)) so that all four share one layout"),
    )
    for lay, out, text in tries:
        try:
            alt = compare_to_reference(out, rec, q, k, v, rtol=rtol, layout=lay,
                                       profile=profile, **params)
        except Exception:  # not even the shapes fit: no hint
            continue
        if alt.ok:
            return text
    return ""
