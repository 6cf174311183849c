"""The call pipeline (:mod:`arrayattn.pipeline`): each public function checks ``q, k, v``
once, on the public and on the registry path."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import _validate


def _count_check_qkv(monkeypatch, modules, q):
    """Wrap ``check_qkv`` as imported by ``modules``; count the calls that check ``q``
    (a variant may check another triple, e.g. Luna's pack step ``p, k, v``)."""
    calls = []
    original = _validate.check_qkv

    def counting(a, *args, **kwargs):
        if a is q:
            calls.append(a)
        return original(a, *args, **kwargs)

    for module in modules:
        if hasattr(module, "check_qkv"):
            monkeypatch.setattr(module, "check_qkv", counting)
    return calls


def _lowrank_modules():
    from arrayattn import _validate_lowrank, linformer, luna, nystrom
    return (_validate_lowrank, nystrom, linformer, luna)


@pytest.mark.parametrize("name, public, options", [
    ("nystrom_iterative", arrayattn.nystrom_attention, {"num_landmarks": 4}),
    ("nystrom_svd", arrayattn.nystrom_attention, {"num_landmarks": 4, "pinv": "svd"}),
    ("landmark", arrayattn.landmark_attention, {"num_landmarks": 4}),
    ("linformer", arrayattn.linformer_attention, {"proj_dim": 4}),
    ("luna", None, {"num_packed": 4}),
])
def test_lowrank_checks_qkv_once(monkeypatch, name, public, options):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 12, 8)) for _ in range(3))
    key_mask = np.arange(12) < 10
    calls = _count_check_qkv(monkeypatch, _lowrank_modules(), q)
    if public is not None:
        public(q, k, v, key_mask=key_mask, **options)
        assert len(calls) == 1, f"{public.__name__}: check_qkv ran {len(calls)} times"
        calls.clear()
    else:
        arrayattn.luna_attention(q, k, v, rng.standard_normal((4, 8)), key_mask=key_mask)
        assert len(calls) == 1, f"luna_attention: check_qkv ran {len(calls)} times"
        calls.clear()
    arrayattn.get_variant(name)(q, k, v, key_mask=key_mask, **options)
    assert len(calls) == 1, f"registry {name}: check_qkv ran {len(calls)} times"


def test_lowrank_specs_say_what_none_means():
    import inspect

    from arrayattn import linformer, luna, nystrom
    for fn, spec in ((arrayattn.nystrom_attention, nystrom.NYSTROM_SPEC),
                     (arrayattn.landmark_attention, nystrom.LANDMARK_SPEC),
                     (arrayattn.linformer_attention, linformer.SPEC),
                     (arrayattn.luna_attention, luna.SPEC)):
        nones = {name for name, par in inspect.signature(fn).parameters.items()
                 if par.default is None}
        assert nones == set(spec.none_means), fn.__name__
