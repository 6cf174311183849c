"""Data shipped with arrayattn: q, k, v of real attention heads (``real_heads``).

``real_heads.npz`` holds 36 heads (layers 0, 2 and 5, all 12 heads) of
sentence-transformers' all-MiniLM-L6-v2 on the opening of *Pride and Prejudice*: 256
tokens, ``d_head = 32``, float16.  Provenance, licences and how to regenerate it:
``arrayattn/data/README.md`` and :mod:`arrayattn.data.make_real_heads`.
"""
from __future__ import annotations

import functools
import json
from importlib import resources

import numpy as np

__all__ = ["real_heads", "real_heads_info"]


@functools.lru_cache(maxsize=1)
def _load():
    with resources.files(__name__).joinpath("real_heads.npz").open("rb") as fh:
        z = np.load(fh)
        arrays = tuple(z[name] for name in ("q", "k", "v"))
        meta = json.loads(str(z["meta"]))
    for a in arrays:
        a.setflags(write=False)
    return arrays, meta


def real_heads():
    """Queries, keys and values of 36 real attention heads, as the model computed them
    (before the softmax; its scale is ``1/sqrt(32)``, arrayattn's default).

    Returns
    -------
    q, k, v : numpy.ndarray, shape ``(36, 256, 32)``, float64
        Heads of layers 0, 2, 5 (12 each, in that order) of all-MiniLM-L6-v2 on 256
        tokens of public-domain text (stored as float16, returned as float64 copies).
        ``‖q‖ ≈ 6.3`` and ``‖k‖ ≈ 7.0`` on average: the norms of trained heads.

    Examples
    --------
    >>> from arrayattn.data import real_heads, real_heads_info
    >>> q, k, v = real_heads()
    >>> q.shape, q.dtype
    ((36, 256, 32), dtype('float64'))
    >>> real_heads_info()["layers"]
    [0, 2, 5]
    """
    arrays, _ = _load()
    return tuple(a.astype(np.float64) for a in arrays)


def real_heads_info() -> dict:
    """The provenance of :func:`real_heads`: model, licence, layers, text, token count.

    Examples
    --------
    >>> from arrayattn.data import real_heads_info
    >>> real_heads_info()["model_licence"]
    'Apache-2.0'
    """
    return dict(_load()[1])
