"""A layout's tiles on the device: blocked inputs, host indices, and the pattern's mask
and a bias on gathered tiles."""
from __future__ import annotations

import array_api_compat
import numpy as np

from ..core.xp import xp_from_host
from ..reference.indexing import take_in_bounds

__all__ = ["host_indices", "tile_mask", "mask_tables", "mask_from", "PER_KEY", "PER_BLOCK",
           "tile_bias", "tile_bias_at", "blocked"]


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
    code = np.where(kpos < layout.s, np.repeat(_block_codes(layout, rows, idx, valid), b,
                                               axis=1), 0)
    qpos = rows[:, None] * b + ar
    gq = None
    if layout.global_tokens.size:
        g = np.zeros(max(layout.n, layout.s) + b * 2, dtype=bool)
        g[layout.global_tokens] = True
        code = np.where((code == 1) & g[kpos], 2, code)
        gq = g[qpos]
        if not gq.any():
            gq = None
    # A row can skip the token-level rules when every slot is already decided.
    needs_rules = layout.window is not None or gq is not None or causal
    kstart, kend = layout.key_span(np.minimum(kpos, layout.s - 1))
    return kstart, kend, code, qpos + layout.shift, gq, needs_rules


def _block_codes(layout, rows, idx, valid):
    """The codes of the key blocks ``idx, valid (G, R)`` gathered by query blocks ``rows``:
    0 padding, 1 reachable, 2 allowed whole."""
    return np.where(valid, np.where(layout.blocks[rows[:, None], idx], 2, 1), 0)


def tile_mask(xp, layout, rows, idx, valid, *, causal: bool, device):
    """The pattern's boolean ``(G, b, R*b)`` mask over the gathered tiles of query blocks
    ``rows`` and key blocks ``idx`` (no key mask), built on ``device`` from ``O(G R b)``
    host integers (:func:`mask_tables`, then :func:`mask_from`)."""
    return mask_from(xp, layout, mask_tables(xp, layout, rows, idx, valid, causal=causal,
                                             device=device), causal=causal)


#: The tables of :func:`mask_tables` with one entry per gathered key slot, and those
#: with one per gathered key block (the others have one per query row).
PER_KEY = ("code", "kend", "kstart")
PER_BLOCK = ("bcode", "idx")


def mask_tables(xp, layout, rows, idx, valid, *, causal: bool, device) -> dict:
    """The host description of the tiles of query blocks ``rows (G,)`` and key blocks
    ``idx, valid (G, R)`` as device int32 arrays, by name, only those the pattern's
    rules use: ``code (G, R*b)`` (0 padding, 1 reachable, 2 allowed by a whole block or a
    global key), ``kend``/``kstart (G, R*b)`` (the keys' last and first positions),
    ``apos (G, b)`` (the queries' positions), ``gq (G, b)`` (global queries).

    Where keys are positions and none is global, every key of a block has its block's
    code, and its position is its block's start plus its offset: then ``bcode`` and
    ``idx (G, R)`` (the blocks' codes and indices) stand for ``code`` and ``kend``,
    which :func:`mask_from` makes on the device -- ``b`` times fewer host integers, which
    a compiled program carries as constants (strided at ``n = 16384``: 21 MB of program
    text with the key tables)."""
    if layout.key_start is None and not layout.global_tokens.size:
        b = layout.block_size
        host = {"bcode": _block_codes(layout, rows, idx, valid), "idx": idx}
        if layout.window is not None or causal:
            host["apos"] = rows[:, None] * b + np.arange(b) + layout.shift
        return {name: host_indices(xp, a, device) for name, a in host.items()}
    kstart, kend, code, apos, gq, needs_rules = _chunk_masks(layout, rows, idx, valid,
                                                             causal=causal)
    host = {"code": code}
    if needs_rules:
        host.update(kend=kend, apos=apos)
        if kstart is not kend:
            host["kstart"] = kstart
        if gq is not None:
            host["gq"] = gq
    return {name: host_indices(xp, a, device) for name, a in host.items()}


def mask_from(xp, layout, t: dict, *, causal: bool):
    """The ``(G, b, R*b)`` mask from the tables ``t`` of :func:`mask_tables` (or a
    scanned chunk's slice of them, ``G`` any leading shape): the one place the pattern's
    token-level rules are applied."""
    if "bcode" in t:
        t = {**t, **_key_tables(xp, layout, t["bcode"], t["idx"], positions="apos" in t)}
    code_x = xp.expand_dims(t["code"], axis=-2)                              # (G, 1, Rb)
    allowed = code_x == 2
    if "apos" not in t:
        return allowed
    kend_x = xp.expand_dims(t["kend"], axis=-2)                              # (G, 1, Rb)
    kstart_x = xp.expand_dims(t["kstart"], axis=-2) if "kstart" in t else kend_x
    apos_x = xp.expand_dims(t["apos"], axis=-1)                              # (G, b, 1)
    reach = code_x >= 1
    if layout.window is not None:
        left, right = layout.window
        allowed = allowed | (reach & (kstart_x >= apos_x - left) & (kend_x <= apos_x + right))
    if "gq" in t:
        allowed = allowed | (reach & (xp.expand_dims(t["gq"], axis=-1) > 0))
    if causal:
        allowed = allowed & (kend_x <= apos_x)
    return allowed


def _key_tables(xp, layout, bcode, kblock, *, positions: bool) -> dict:
    """``code`` and (with ``positions``) ``kend (G, R*b)`` of point keys from their
    blocks' codes ``bcode`` and indices ``kblock (G, R)`` (:func:`mask_tables`): a slot
    past the last key is padding."""
    b, s = layout.block_size, layout.s
    ar = xp.arange(b, dtype=kblock.dtype, device=array_api_compat.device(kblock))
    kpos = xp.reshape(xp.expand_dims(kblock, axis=-1) * b + ar,
                      (*kblock.shape[:-1], kblock.shape[-1] * b))
    code = xp.reshape(xp.broadcast_to(xp.expand_dims(bcode, axis=-1), (*bcode.shape, b)),
                      kpos.shape)
    out = {"code": xp.where(kpos < s, code, xp.zeros_like(code))}
    if positions:
        out["kend"] = xp.minimum(kpos, s - 1)
    return out


def tile_bias(xp, bias, rows, kpos, layout, device):
    """The bias on the gathered tiles ``(..., G, b, K)`` of query blocks ``rows (G,)`` and
    key positions ``kpos (G, K)`` (host integers; :func:`tile_bias_at`)."""
    return tile_bias_at(xp, bias, host_indices(xp, rows, device),
                        host_indices(xp, kpos, device), layout)


def tile_bias_at(xp, bias, rows, kpos, layout):
    """The bias on the gathered tiles ``(..., G, b, K)``: its rows of query blocks
    ``rows (G,)``, then each group's key positions ``kpos (G, K)`` (device integers;
    positions past the ends read a clamped entry, which the mask takes out)."""
    b, n, s = layout.block_size, layout.n, layout.s
    dev = array_api_compat.device(bias)
    index = xp.__array_namespace_info__().default_dtypes(device=dev)["indexing"]  # torch: int64
    ar = xp.arange(b, dtype=index, device=dev)
    qrows = xp.minimum(xp.astype(rows, index)[:, None] * b + ar, n - 1)       # (G, b)
    rb = take_in_bounds(bias, xp.reshape(qrows, (-1,)), axis=bias.ndim - 2)
    rb = xp.reshape(rb, (*rb.shape[:-2], rows.shape[0], b, s))
    cols = xp.minimum(xp.astype(kpos, index), s - 1)[:, None, :]             # (G, 1, K)
    return xp.take_along_axis(rb, xp.broadcast_to(cols, (*rb.shape[:-1], kpos.shape[-1])),
                              axis=-1)


def blocked(xp, x, nb: int, b: int, *, device):
    """``x (..., t, c)`` padded with zero rows to ``nb * b`` tokens, as ``(..., nb, b, c)``."""
    pad = nb * b - x.shape[-2]
    if pad:
        x = xp.concat([x, xp.zeros((*x.shape[:-2], pad, x.shape[-1]), dtype=x.dtype,
                                   device=device)], axis=-2)
    return xp.reshape(x, (*x.shape[:-2], nb, b, x.shape[-1]))
