"""A layout's tiles on the device: blocked inputs, host indices, and the pattern's mask
and a bias on gathered tiles."""
from __future__ import annotations

import numpy as np

from .._xp import xp_from_host

__all__ = ["host_indices", "tile_mask", "tile_bias", "blocked"]


def host_indices(xp, a, device):
    """Host integers (block indices, positions) to ``xp`` int32 on ``device`` (every
    library has int32; JAX without x64 has no int64, and these indices are small)."""
    return xp_from_host(xp, np.asarray(a, dtype=np.int32), dtype=xp.int32, device=device)


def _chunk_masks(layout, rows, idx, valid, *, causal: bool):
    """Host description of one chunk: first and last positions of the gathered keys
    ``(G, R*b)`` (the same array unless keys are intervals), slot codes (0 = padding,
    1 = reachable, 2 = allowed by a whole block or a global key), query positions
    ``(G, b)`` and, for global queries, a flag ``(G, b)``."""
    b = layout.block_size
    ar = np.arange(b)
    kpos = (idx[:, :, None] * b + ar).reshape(idx.shape[0], -1)
    kvalid = np.repeat(valid, b, axis=1) & (kpos < layout.s)
    full = np.repeat(layout.blocks[rows[:, None], idx], b, axis=1)
    qpos = rows[:, None] * b + ar
    gq = None
    if layout.global_tokens.size:
        g = np.zeros(max(layout.n, layout.s) + b * 2, dtype=bool)
        g[layout.global_tokens] = True
        full = full | g[kpos]
        gq = g[qpos]
        if not gq.any():
            gq = None
    code = np.where(kvalid, np.where(full, 2, 1), 0)
    # A row can skip the token-level rules when every slot is already decided.
    needs_rules = layout.window is not None or gq is not None or causal
    kstart, kend = layout.key_span(np.minimum(kpos, layout.s - 1))
    return kstart, kend, code, qpos + layout.shift, gq, needs_rules


def tile_mask(xp, layout, rows, idx, valid, *, causal: bool, device):
    """The pattern's boolean ``(G, b, R*b)`` mask over the gathered tiles of query blocks
    ``rows`` and key blocks ``idx`` (no key mask), built on ``device`` from ``O(G R b)``
    host integers. The one place the pattern's token-level rules are applied."""
    kstart, kend, code, apos, gq, needs_rules = _chunk_masks(layout, rows, idx, valid,
                                                             causal=causal)
    code_x = xp.expand_dims(host_indices(xp, code, device), axis=-2)          # (G, 1, Rb)
    allowed = code_x == 2
    if not needs_rules:
        return allowed
    kend_x = xp.expand_dims(host_indices(xp, kend, device), axis=-2)          # (G, 1, Rb)
    kstart_x = kend_x if kstart is kend else xp.expand_dims(host_indices(xp, kstart, device),
                                                            axis=-2)
    apos_x = xp.expand_dims(host_indices(xp, apos, device), axis=-1)          # (G, b, 1)
    reach = code_x >= 1
    if layout.window is not None:
        left, right = layout.window
        allowed = allowed | (reach & (kstart_x >= apos_x - left) & (kend_x <= apos_x + right))
    if gq is not None:
        allowed = allowed | (reach & (xp.expand_dims(host_indices(xp, gq, device), axis=-1) > 0))
    if causal:
        allowed = allowed & (kend_x <= apos_x)
    return allowed


def tile_bias(xp, bias, rows, kpos, layout, device):
    """The bias on the gathered tiles ``(..., G, b, R*b)``: its query rows, then each
    group's key positions (padding slots read a clamped, masked-off entry)."""
    b, n, s = layout.block_size, layout.n, layout.s
    qrows = np.minimum(rows[:, None] * b + np.arange(b), n - 1).reshape(-1)
    rb = xp.take(bias, host_indices(xp, qrows, device), axis=bias.ndim - 2)
    rb = xp.reshape(rb, (*rb.shape[:-2], rows.size, b, s))
    info = xp.__array_namespace_info__()
    index = info.default_dtypes(device=device)["indexing"]   # torch: int64 only
    cols = xp_from_host(xp, np.minimum(kpos, s - 1)[:, None, :], dtype=index, device=device)
    return xp.take_along_axis(rb, xp.broadcast_to(cols, (*rb.shape[:-1], kpos.shape[1])),
                              axis=-1)


def blocked(xp, x, nb: int, b: int, *, device):
    """``x (..., t, c)`` padded with zero rows to ``nb * b`` tokens, as ``(..., nb, b, c)``."""
    pad = nb * b - x.shape[-2]
    if pad:
        x = xp.concat([x, xp.zeros((*x.shape[:-2], pad, x.shape[-1]), dtype=x.dtype,
                                   device=device)], axis=-2)
    return xp.reshape(x, (*x.shape[:-2], nb, b, x.shape[-1]))
