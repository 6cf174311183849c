"""The call pipeline (:mod:`arrayattn.core.pipeline`, issue #27): each public function checks
``q, k, v`` once per call, on the public path and on the registry's."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn.core import checks as _validate
from arrayattn.gated import checks as _validate_gated


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
    calls = _count_everywhere(monkeypatch, q)
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

    from arrayattn.lowrank import linformer, luna, nystrom
    for fn, spec in ((arrayattn.nystrom_attention, nystrom.NYSTROM_SPEC),
                     (arrayattn.landmark_attention, nystrom.LANDMARK_SPEC),
                     (arrayattn.linformer_attention, linformer.SPEC),
                     (arrayattn.luna_attention, luna.SPEC)):
        nones = {name for name, par in inspect.signature(fn).parameters.items()
                 if par.default is None}
        assert nones == set(spec.none_means), fn.__name__


def _count_everywhere(monkeypatch, q):
    """Wrap ``check_qkv`` in every arrayattn module that imported it; count the calls
    that check ``q`` itself (a variant may check another triple: Luna's ``p, k, v``)."""
    import sys
    calls = []
    original = _validate.check_qkv

    def counting(a, *args, **kwargs):
        if a is q:
            calls.append(a)
        return original(a, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("arrayattn") and getattr(module, "check_qkv", None) is original:
            monkeypatch.setattr(module, "check_qkv", counting)
    return calls


@pytest.mark.parametrize("engine", ["auto", "reference"])
@pytest.mark.parametrize("name", [rec.name for rec in arrayattn.variants()])
def test_every_registry_call_checks_qkv_once(name, engine, monkeypatch):
    """The uniform call of every catalogue record runs ``check_qkv`` on its ``q`` exactly
    once (an adapter that drew gates or built a layout used to check, then call the
    public function that checked again)."""
    rec = arrayattn.get_variant(name)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 72, 8)) for _ in range(3))   # n > 64 landmarks
    calls = _count_everywhere(monkeypatch, q)
    with arrayattn.use_engine(engine):
        out = rec(q, k, v)
    assert out.shape == (1, 2, 72, 8)
    assert len(calls) == 1, f"{name}: check_qkv ran {len(calls)} times on q"


_SPARSE_PUBLIC = {
    "sparse_attention": lambda q, k, v: arrayattn.sparse_attention(
        q, k, v, layout=arrayattn.bigbird_layout(40, block_size=4, num_random_blocks=1)),
    "local_attention": lambda q, k, v: arrayattn.local_attention(q, k, v, window=3,
                                                                 block_size=8),
    "pooling_attention": lambda q, k, v: arrayattn.pooling_attention(
        q, k, v, window=3, pool_window=8, pool_size=2, block_size=8),
    "lsh_attention": lambda q, k, v: arrayattn.lsh_attention(q, v, num_hashes=2,
                                                             chunk_size=8),
}


@pytest.mark.parametrize("engine", ["auto", "reference"])
@pytest.mark.parametrize("name", sorted(_SPARSE_PUBLIC))
def test_sparse_public_functions_check_qkv_once(name, engine, monkeypatch):
    q, k, v = (np.random.default_rng(0).standard_normal((2, 40, 8)) for _ in range(3))
    calls = _count_everywhere(monkeypatch, q)
    with arrayattn.use_engine(engine):
        out = _SPARSE_PUBLIC[name](q, k, v)
    assert out.shape == (2, 40, 8) and len(calls) == 1


_KERNEL_CALLS = {
    "linear_attention": lambda q, k, v: arrayattn.linear_attention(q, k, v, causal=True),
    "linear_state": lambda q, k, v: arrayattn.linear_attention(q, k, v, return_state=True),
    "linear_user_map": lambda q, k, v: arrayattn.linear_attention(
        q, k, v, feature_map=lambda x: x * x),
    "feature_attention": lambda q, k, v: arrayattn.feature_attention(q, k, v, causal=True),
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
def test_kernel_public_functions_check_qkv_once(monkeypatch, name, engine):
    """linear, feature, efficient, Performer and RFA attention: one check per call (RFA
    used to validate again through feature_attention, FAVOR++ through gerf_parameter)."""
    q, k, v = (np.random.default_rng(0).standard_normal((2, 6, 4)) for _ in range(3))
    calls = _count_everywhere(monkeypatch, q)
    with arrayattn.use_engine(engine):
        _KERNEL_CALLS[name](q, k, v)
    assert len(calls) == 1


def test_only_the_pipeline_chooses_an_implementation():
    """Issue #27 point 1: ``numpy_engine(`` and ``dense_reference(`` are called only in
    :mod:`arrayattn.core.pipeline` (and defined in :mod:`arrayattn.core.engine`); the engine's
    ``LOCK`` is named only inside :mod:`arrayattn._numpy`."""
    import pathlib
    import re

    root = pathlib.Path(arrayattn.__file__).parent
    calls = re.compile(r"\b(numpy_engine|dense_reference)\(")
    lock = re.compile(r"\bLOCK\b")
    wrong = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            for name in calls.findall(code):
                defined = rel == "core/engine.py" and code.lstrip().startswith(f"def {name}(")
                if rel != "core/pipeline.py" and not defined:
                    wrong.append(f"{rel}:{number}: calls {name}: {line.strip()}")
            if lock.search(code) and not rel.startswith("_numpy/"):
                wrong.append(f"{rel}:{number}: names LOCK: {line.strip()}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", [rec.name for rec in arrayattn.variants() if rec.cross])
def test_no_query_gives_an_empty_output_for_every_variant(name):
    """``n = 0`` queries with keys (the pipeline's empty problem): an empty output of the
    right shape, and empty or zero gradients -- local and Poolingformer built a layout of
    no query and raised."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 0, 8))
    k, v = (rng.standard_normal((1, 2, 72, 8)) for _ in range(2))
    assert arrayattn.get_variant(name)(q, k, v).shape == (1, 2, 0, 8)
    grads = arrayattn.vjp(name, q, k, v, np.ones((1, 2, 0, 8)))
    assert grads["q"].shape == q.shape and not np.any(grads["k"]) and not np.any(grads["v"])


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_paged_attention_is_one_spec_checked_once(monkeypatch, heads):
    """Issue #38 point 5: :func:`~arrayattn.paged_attention` is ``return run(PAGED_SPEC,
    ...)`` like every public function: its check validates ``q`` and the caches, groups the
    heads and makes exact attention's call record once; ``run`` checks nothing again."""
    import inspect

    from arrayattn.core.pipeline import Spec
    from arrayattn.exact import checks as exact_checks, paged

    source = inspect.getsource(paged.paged_attention)
    assert source.rstrip().splitlines()[-2].strip().startswith("return run(PAGED_SPEC,")
    assert isinstance(paged.PAGED_SPEC, Spec) and paged.PAGED_SPEC.check is paged.checked_paged
    rng = np.random.default_rng(1)
    hq, hk = heads
    k_cache, v_cache = rng.standard_normal((2, 5, 4, hk, 8))
    q = rng.standard_normal((2, hq, 3, 8))
    table, lens = np.array([[3, 0], [1, 4]]), np.array([7, 5])
    calls = _counting_check_qkv(monkeypatch, exact_checks)
    out = arrayattn.paged_attention(q, k_cache, v_cache, table, lens, causal=True)
    assert len(calls) == 1, f"paged_attention checked q, k, v {len(calls)} times"
    k = np.concatenate([k_cache[table[0, 0]], k_cache[table[0, 1]]])[:7].transpose(1, 0, 2)
    v = np.concatenate([v_cache[table[0, 0]], v_cache[table[0, 1]]])[:7].transpose(1, 0, 2)
    k, v = np.repeat(k, hq // hk, axis=0), np.repeat(v, hq // hk, axis=0)
    np.testing.assert_allclose(out[0], arrayattn.softmax_attention(q[0], k, v, causal=True),
                               rtol=1e-12, atol=1e-12)
