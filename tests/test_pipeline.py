"""The call pipeline (:mod:`arrayattn.pipeline`, issue #27): each public function checks
``q, k, v`` once per call, on the public path and on the registry's."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import _validate_gated


def _counting_check_qkv(monkeypatch, module):
    """Wrap ``module.check_qkv`` (the one the module imported) and count its calls."""
    calls = []
    real = module.check_qkv

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, "check_qkv", counted)
    return calls


def _gated_inputs():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 8, 4)) for _ in range(3))
    gates = {"retention": (), "gla": (-rng.random((2, 3, 8, 4)),),
             "ssd": (-rng.random((2, 3, 8)),), "deltanet": (rng.random((2, 3, 8)),),
             "gated_deltanet": (rng.random((2, 3, 8)), -rng.random((2, 3, 8)))}
    return q, k, v, gates


GATED = {"retention": arrayattn.retention, "gla": arrayattn.gla_attention,
         "ssd": arrayattn.ssd_attention, "deltanet": arrayattn.delta_attention,
         "gated_deltanet": arrayattn.gated_delta_attention}
GATE_NAMES = {"retention": (), "gla": ("g",), "ssd": ("a",), "deltanet": ("beta",),
              "gated_deltanet": ("beta", "g")}


@pytest.mark.parametrize("name", sorted(GATED))
@pytest.mark.parametrize("path", ["public", "registry", "public_vjp", "registry_vjp"])
def test_gated_checks_qkv_once(monkeypatch, name, path):
    """The gated family: one ``check_qkv`` per call (``_validate_gated`` holds the family's
    only import of it; the uniform call draws its gates after that one check)."""
    q, k, v, gates = _gated_inputs()
    fn = GATED[name]
    calls = _counting_check_qkv(monkeypatch, _validate_gated)
    if path == "public":
        out = fn(q, k, v, *gates[name], return_state=True)[0]
    elif path == "registry":
        out = arrayattn.get_variant(name)(q, k, v)
    else:
        options = {}
        if path == "public_vjp":
            options = dict(zip(GATE_NAMES[name], gates[name]))
        variant = fn if path == "public_vjp" else name
        out = arrayattn.vjp(variant, q, k, v, np.ones_like(v), **options)["q"]
    assert out.shape == q.shape
    assert len(calls) == 1, f"{name} ({path}) checked q, k, v {len(calls)} times"
