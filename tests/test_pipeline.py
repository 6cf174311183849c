"""The call pipeline (:mod:`arrayattn.pipeline`): each public function checks ``q, k, v``
once, on its public path and on the registry's uniform call."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import registry


def _count_check_qkv(monkeypatch, module):
    """Wrap ``check_qkv`` as ``module`` imported it; returns the list of calls."""
    calls = []
    inner = module.check_qkv

    def counted(*args, **kwargs):
        calls.append(kwargs.get("names"))
        return inner(*args, **kwargs)
    monkeypatch.setattr(module, "check_qkv", counted)
    return calls


_SPARSE_CALLS = {
    "sparse_attention": lambda q, k, v: arrayattn.sparse_attention(
        q, k, v, layout=arrayattn.bigbird_layout(40, block_size=4, num_random_blocks=1)),
    "local_attention": lambda q, k, v: arrayattn.local_attention(q, k, v, window=3,
                                                                 block_size=8),
    **{name: (lambda q, k, v, name=name: registry.get_variant(name)(q, k, v))
       for name in ("local", "longformer", "bigbird", "strided", "fixed")},
}


@pytest.mark.parametrize("engine", ["auto", "reference"])
@pytest.mark.parametrize("name", sorted(_SPARSE_CALLS))
def test_sparse_family_checks_qkv_once(name, engine, monkeypatch):
    import arrayattn.sparse.api as api
    calls = _count_check_qkv(monkeypatch, api)
    q, k, v = (np.random.default_rng(0).standard_normal((2, 40, 8)) for _ in range(3))
    with arrayattn.use_engine(engine):
        out = _SPARSE_CALLS[name](q, k, v)
    assert out.shape == (2, 40, 8) and len(calls) == 1


@pytest.mark.parametrize("engine", ["auto", "reference"])
@pytest.mark.parametrize("path", ["public", "registry"])
def test_pooling_family_checks_qkv_once(path, engine, monkeypatch):
    import arrayattn.pooling as pooling
    calls = _count_check_qkv(monkeypatch, pooling)
    q, k, v = (np.random.default_rng(0).standard_normal((2, 40, 8)) for _ in range(3))
    with arrayattn.use_engine(engine):
        if path == "public":
            out = arrayattn.pooling_attention(q, k, v, window=4, pool_window=16, block_size=8)
        else:
            out = registry.get_variant("poolingformer")(q, k, v)
    assert out.shape == (2, 40, 8) and len(calls) == 1


@pytest.mark.parametrize("engine", ["auto", "reference"])
@pytest.mark.parametrize("path", ["public", "registry", "buckets"])
def test_lsh_family_checks_qkv_once(path, engine, monkeypatch):
    import arrayattn.lsh as lsh
    calls = _count_check_qkv(monkeypatch, lsh)
    qk, v = (np.random.default_rng(0).standard_normal((2, 40, 8)) for _ in range(2))
    with arrayattn.use_engine(engine):
        if path == "public":
            out = arrayattn.lsh_attention(qk, v, num_hashes=2, chunk_size=8)
        elif path == "registry":
            out = registry.get_variant("lsh")(qk, qk, v)
        else:
            out = arrayattn.lsh_buckets(qk, num_hashes=2)
    assert out.shape[-1] in (8, 40) and len(calls) == 1
    assert calls[0] == (("q", "q", "v") if path == "registry" else ("qk", "qk", "v"))
