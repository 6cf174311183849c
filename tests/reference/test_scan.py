"""The one loop helper (``reference/scan.py``, #26) and the forms written with it.

``scan``/``fori``/``cond`` are ``jax.lax`` loops on JAX and plain Python loops elsewhere;
these tests check the two agree (results, reverse order, static tables, a carry that
starts smaller than it ends, skipped steps), and that ``jax.grad`` through every scanned
reference form equals torch autograd through the same form run as the plain (unrolled)
loop, float64, to 1e-10 relative (the backward issue's bar).
"""
from __future__ import annotations

import numpy as np
import pytest

from arrayattn import reference as R
from arrayattn.reference.logits import Logits
from arrayattn.reference.scan import cond, fori, scan

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

RTOL = 1e-10


def _close(got, want, rtol=RTOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    scale = max(float(np.max(np.abs(want))), 1e-300) if want.size else 1.0
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:g} x {scale:.3g}"


# --- the helper ------------------------------------------------------------------------

def _cumulative(xp_x, reverse=False):
    def step(c, x):
        c = c + x
        return c, c * 2.0
    return scan(step, xp_x[..., 0, :] * 0.0, (xp_x,), axis=-2, reverse=reverse)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_numpy_and_jax_agree(reverse):
    x = np.random.default_rng(0).standard_normal((3, 7, 4))
    c_np, y_np = _cumulative(x, reverse)
    c_jx, y_jx = jax.jit(lambda x: _cumulative(x, reverse))(jnp.asarray(x))
    _close(c_jx, c_np, 1e-14)
    _close(y_jx, y_np, 1e-14)
    want = np.cumsum(x[:, ::-1], axis=1)[:, ::-1] if reverse else np.cumsum(x, axis=1)
    _close(y_np, 2 * want, 1e-14)


def test_scan_static_tables_and_like():
    """A ``range``/list in ``xs`` gives Python ints off JAX, traced ints on JAX; ``like``
    names the namespace when nothing else is an array."""
    seen = []

    def step(_, i, w):
        seen.append(type(i))
        return None, (i * w) * jnp.ones(2) if isinstance(i, jax.Array) else (
            np.full(2, float(i * w)))

    _, ys = scan(step, None, (range(4), [1, 2, 3, 4]), axis=0, like=np.zeros(1))
    assert seen == [int] * 4 and ys.tolist() == [[0, 0], [2, 2], [6, 6], [12, 12]]
    _, yj = scan(step, None, (range(4), [1, 2, 3, 4]), axis=0, like=jnp.zeros(1))
    _close(yj, ys, 0)


def test_scan_carry_settles_on_jax():
    """A ``(f,)`` float32 zero start that the first step broadcasts to ``(b, f)`` and
    promotes to float64: the plain loop grows it; on JAX it is grown once up front."""
    x = np.random.default_rng(1).standard_normal((2, 5, 3))

    def run(x):
        return scan(lambda c, xt: (c + xt, None), jnp.zeros(3, jnp.float32) if isinstance(
            x, jax.Array) else np.zeros(3, np.float32), (x,), axis=-2)[0]

    got = jax.jit(run)(jnp.asarray(x))
    assert got.shape == (2, 3) and got.dtype == jnp.float64
    _close(got, run(x), 1e-14)


def test_cond_and_fori():
    assert cond(True, lambda c: c + 1, 1) == 2 and cond(False, lambda c: c + 1, 1) == 1
    with pytest.raises(TypeError):
        cond(np.bool_(True), lambda c: c, 1)
    f = jax.jit(lambda p, c: cond(p, lambda c: c * 2.0, c))
    assert float(f(True, 3.0)) == 6.0 and float(f(False, 3.0)) == 3.0
    a = np.random.default_rng(2).standard_normal((4, 4))
    _close(jax.jit(lambda a: fori(lambda z: z @ a, a, 5))(jnp.asarray(a)),
           fori(lambda z: z @ a, a, 5), 1e-12)


# --- jax.grad through the scanned forms == torch autograd through the plain loops --------

def _grads(backend, form, args, weights):
    """Gradients of ``sum_i <out_i, w_i>`` with respect to every argument."""
    if backend == "jax":
        def loss(*a):
            outs = form(*a)
            outs = outs if isinstance(outs, tuple) else (outs,)
            return sum(jnp.sum(o * w) for o, w in zip(outs, weights))
        xs = [jnp.asarray(a) for a in args]
        return [np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=tuple(range(len(xs)))))(*xs)]
    ts = [torch.tensor(a, requires_grad=True) for a in args]
    outs = form(*ts)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o * torch.tensor(w)).sum() for o, w in zip(outs, weights)).backward()
    return [np.zeros(t.shape) if t.grad is None else t.grad.numpy() for t in ts]


def _check(form, args, seed=0):
    args = [np.asarray(a, dtype=np.float64) for a in args]
    outs = form(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(np.shape(o)) for o in outs]
    for got, want in zip(_grads("jax", form, args, weights),
                         _grads("torch", form, args, weights)):
        _close(got, want)


def _qkv(rng, n=37, d=6, dv=5, batch=(2, 2)):
    return (rng.standard_normal((*batch, n, d)), rng.standard_normal((*batch, n, d)),
            rng.standard_normal((*batch, n, dv)))


@pytest.mark.parametrize("per_dim", [True, False])
def test_grad_gla(per_dim):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng)
    g = -np.abs(rng.standard_normal((*q.shape[:-1], q.shape[-1] if per_dim else 1))) * 0.3
    s0 = rng.standard_normal((*q.shape[:-2], q.shape[-1], v.shape[-1]))
    _check(R.gla_recurrent, (q, k, v, g, s0))
    _check(lambda *a: R.gla_chunked(*a, 8), (q, k, v, g, s0))


@pytest.mark.parametrize("gated", [True, False])
def test_grad_delta(gated):
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    beta = 1 / (1 + np.exp(-rng.standard_normal(q.shape[:-1])))
    g = (-np.abs(rng.standard_normal((*q.shape[:-1], 1))) * 0.2) if gated else (
        np.zeros((*q.shape[:-1], 1)))
    s0 = rng.standard_normal((*q.shape[:-2], q.shape[-1], v.shape[-1]))
    _check(R.delta_recurrent, (q, k, v, beta, g, s0))
    _check(lambda *a: R.delta_chunked(*a, 8), (q, k, v, beta, g, s0))


def test_grad_kernel_recurrent():
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng)
    v1 = np.concatenate([v, np.ones((*v.shape[:-1], 1))], axis=-1)
    sz0 = np.abs(rng.standard_normal((*q.shape[:-2], q.shape[-1], v1.shape[-1])))
    _check(R.kernel_recurrent, (np.abs(q), np.abs(k), v1, sz0))


@pytest.mark.parametrize("with_state", [False, True])
def test_grad_kernel_chunked_running_sum(with_state):
    """19 chunks of 2 tokens: on JAX the states between chunks are a ``fori_loop``
    (``running_sum`` past 16 steps); torch runs the cumulative sum."""
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng)
    v1 = np.concatenate([v, np.ones((*v.shape[:-1], 1))], axis=-1)
    sz0 = np.abs(rng.standard_normal((*q.shape[:-2], q.shape[-1], v1.shape[-1])))
    if with_state:
        _check(lambda *a: R.kernel_chunked(*a, 2), (np.abs(q), np.abs(k), v1, sz0))
    else:
        _check(lambda *a: R.kernel_chunked(*a, None, 2), (np.abs(q), np.abs(k), v1))


def test_grad_gated_rfa():
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng)
    v1 = np.concatenate([v, np.ones((*v.shape[:-1], 1))], axis=-1)
    g = 1 / (1 + np.exp(-rng.standard_normal(q.shape[:-1]) - 1.0))
    _check(R.gated_recurrent, (np.abs(q), np.abs(k), v1, g))
    _check(lambda *a: R.gated_chunked(*a, 8), (np.abs(q), np.abs(k), v1, g))


@pytest.mark.parametrize("options", [{}, {"right": 0}, {"left": 9, "right": 0},
                                     {"left": 4, "right": 3, "softcap": 2.0}])
def test_grad_blockwise(options):
    """Blockwise exact over key blocks; with a window some query blocks skip key blocks
    (``cond``), and ``n``, ``s`` are not multiples of the block (repeated rows/keys)."""
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, n=29)
    k, v = k[..., :27, :], v[..., :27, :]
    lg = Logits(scale=0.4, shift=27 - 29, **options)
    _check(lambda q, k, v: R.attention_blockwise(q, k, v, lg, block_size=5), (q, k, v))


@pytest.mark.parametrize("dedup", [True, False])
def test_grad_lsh_blocks_of_chunks(monkeypatch, dedup):
    """LSH's scans over the hash rounds and the blocks of chunks: one chunk per block,
    then blocks of 3 chunks (10 chunks of 4 tokens: 2 pad chunks fill the last block)
    with padding (a key mask computed from the input: piecewise constant, as the
    buckets are)."""
    import arrayattn.reference.lsh as lsh_module

    monkeypatch.setattr(lsh_module, "_TILE", 1)           # one chunk per block
    rng = np.random.default_rng(8)
    qk, _, v = _qkv(rng, n=40)
    rot = rng.standard_normal((3, qk.shape[-1], 2))       # 3 rounds, 4 buckets
    for causal in (False, True):
        _check(lambda qk, v, rot: R.lsh_attention_chunked(qk, v, rot, num_buckets=4,
                                                         chunk_size=4, scale=0.5,
                                                         causal=causal, dedup=dedup),
               (qk, v, rot))
    monkeypatch.setattr(lsh_module, "_TILE", 3 * 4 * 2 * 4 * 4)   # blocks of 3 chunks
    _check(lambda qk, v, rot: R.lsh_attention_chunked(
        qk, v, rot, num_buckets=4, chunk_size=4, scale=0.5, causal=True, dedup=dedup,
        key_mask=qk[..., 0] > -0.8), (qk, v, rot))


def test_lsh_chunked_backward_scanned():
    """The chunked LSH backward (its rounds and blocks scanned) under ``jax.jit`` equals
    the plain loops on NumPy."""
    from arrayattn.reference.lsh_vjp import lsh_attention_chunked_vjp

    rng = np.random.default_rng(11)
    qk, _, v = _qkv(rng, n=41)
    do = rng.standard_normal(v.shape)
    km = rng.random(qk.shape[:-1]) < 0.8
    rot = rng.standard_normal((3, qk.shape[-1], 2))
    opts = dict(num_buckets=4, chunk_size=4, scale=0.5, causal=True)
    want = lsh_attention_chunked_vjp(qk, v, do, rot, key_mask=km, **opts)
    got = jax.jit(lambda *a: lsh_attention_chunked_vjp(*a[:4], key_mask=a[4], **opts))(
        *(jnp.asarray(x) for x in (qk, v, do, rot, km)))
    for name in ("qk", "v"):
        _close(got[name], want[name])


def test_grad_pinv_razavi():
    rng = np.random.default_rng(9)
    a = rng.standard_normal((2, 6, 6)) + 6 * np.eye(6)
    _check(lambda a: R.pinv_razavi(a, 8), (a,))


# --- the scanned block-sparse form ---------------------------------------------------------

@pytest.mark.parametrize("backend", ["numpy", "jax"])
def _sparse_budget_case(monkeypatch, budget: int, *, seed: int):
    """A causal BigBird layout on n = 80 whose executor budget holds ``budget`` slots of a
    part (3: parts of 3 key blocks; 30: chunks of 4 query blocks), and its inputs
    ``(q, k, v, bias, key_mask)`` with batch 2."""
    import arrayattn

    lay = arrayattn.bigbird_layout(80, block_size=4, num_random_blocks=2, seed=1,
                                   causal=True)
    b, batch, d = 4, 2, 6
    per_slot = batch * (b * b + b * (d + d))
    monkeypatch.setattr(arrayattn.core.devices, "CPU_CHUNK", budget * per_slot + 1)
    rng = np.random.default_rng(seed)
    q, k, v = _qkv(rng, n=80, d=d, dv=d, batch=(batch,))
    return lay, (q, k, v, rng.standard_normal((batch, 80, 80)), rng.random((batch, 80)) < 0.8)


@pytest.mark.parametrize("budget", [3, 30])
def test_sparse_uneven_chunks_and_parts(backend, budget, monkeypatch):
    """Budget 3: parts of 3 key blocks (the last part of a row filled with masked slots);
    30: chunks of 4 query blocks (the last chunk filled by repeating a block).  With a
    bias and a key mask: equal to the dense definition."""
    import arrayattn
    lay, (q, k, v, bias, km) = _sparse_budget_case(monkeypatch, budget, seed=10)
    ref = arrayattn.softmax_attention(q, k, v, mask=lay.dense_mask(), bias=bias,
                                      key_mask=km, causal=True)
    xs = (q, k, v, bias, km) if backend == "numpy" else tuple(jnp.asarray(x) for x in (
        q, k, v, bias, km))
    run = lambda q, k, v, bias, km: arrayattn.sparse_attention(   # noqa: E731
        q, k, v, layout=lay, bias=bias, key_mask=km, causal=True)
    got = run(*xs) if backend == "numpy" else jax.jit(run)(*xs)   # small: not the engine
    _close(got, ref, 1e-12)


@pytest.mark.parametrize("budget", [3, 30])
def test_grad_sparse_scanned(budget, monkeypatch):
    """``jax.grad`` through the scanned block-sparse executor (chunks of query blocks, the
    last filled by a repeated block; parts of key blocks merged by log-sum-exp) equals
    torch autograd through the same form run as plain loops: ``q``, ``k``, ``v`` and the
    bias, with a key mask, causal."""
    import arrayattn
    lay, (q, k, v, bias, km) = _sparse_budget_case(monkeypatch, budget, seed=11)

    def form(q, k, v, bias):
        mask = (jnp.asarray(km) if isinstance(q, jax.Array) else
                torch.tensor(km) if isinstance(q, torch.Tensor) else km)
        return arrayattn.sparse_attention(q, k, v, layout=lay, bias=bias, key_mask=mask,
                                          causal=True)

    _check(form, (q, k, v, bias))
