"""The one call pipeline (arrayattn.pipeline.run): each public function checks q, k, v
once, on the public path and on the registry's uniform call."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import arrayattn


def _count_check_qkv(monkeypatch):
    """Wrap ``check_qkv`` wherever an arrayattn module imported it; returns the list of
    calls (one entry per call)."""
    import arrayattn._validate as validate
    original = validate.check_qkv
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("names"))
        return original(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("arrayattn") and getattr(module, "check_qkv", None) is original:
            monkeypatch.setattr(module, "check_qkv", counted)
    return calls


_KERNEL_CALLS = {
    "linear_attention": lambda q, k, v: arrayattn.linear_attention(q, k, v, causal=True),
    "linear_state": lambda q, k, v: arrayattn.linear_attention(q, k, v, return_state=True),
    "linear_user_map": lambda q, k, v: arrayattn.linear_attention(
        q, k, v, feature_map=lambda x: x * x),
    "feature_attention": lambda q, k, v: arrayattn.feature_attention(
        abs(q), abs(k), v, causal=True),
    "efficient_attention": lambda q, k, v: arrayattn.efficient_attention(q, k, v),
    "performer_attention": lambda q, k, v: arrayattn.performer_attention(q, k, v,
                                                                         causal=True),
    "performer_favorpp": lambda q, k, v: arrayattn.performer_attention(q, k, v,
                                                                       kind="favor++"),
    "rfa_attention": lambda q, k, v: arrayattn.rfa_attention(q, k, v, causal=True),
    "rfa_gated": lambda q, k, v: arrayattn.rfa_attention(q, k, v, causal=True, gate=0.9),
}


@pytest.mark.parametrize("engine", ["reference", "numpy"])
@pytest.mark.parametrize("name", sorted(_KERNEL_CALLS))
def test_kernel_family_checks_qkv_once(monkeypatch, name, engine):
    """linear, feature, efficient, Performer and RFA attention: one check_qkv per call
    (RFA used to validate again through feature_attention, FAVOR++ through
    gerf_parameter)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))
    calls = _count_check_qkv(monkeypatch)
    with arrayattn.use_engine(engine):
        _KERNEL_CALLS[name](q, k, v)
    assert len(calls) == 1, calls


@pytest.mark.parametrize("name", [r.name for r in arrayattn.variants()
                                  if r.name.startswith(("linear_", "performer_", "rfa",
                                                        "efficient"))])
def test_kernel_family_registry_path_checks_qkv_once(monkeypatch, name):
    """The registry's uniform call (``performer_*``: its ``omega=`` adapter) validates
    once too."""
    rec = arrayattn.get_variant(name)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))
    calls = _count_check_qkv(monkeypatch)
    rec(q, k, v)
    assert len(calls) == 1, calls
    calls.clear()
    if name.startswith("performer_"):
        rec(q, k, v, omega=rng.standard_normal((8, 4)))
        assert len(calls) == 1, calls
