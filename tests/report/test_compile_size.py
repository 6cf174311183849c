"""Compile once, whatever n (#26): the program ``jax.jit`` compiles does not grow with n.

Every loop over tokens, chunks, key blocks, hash rounds or pinv iterations in the
reference forms is a :func:`arrayattn.reference.scan.scan` (``jax.lax.scan`` on JAX), so
the lowered program -- counted in StableHLO operations -- is the same size at two
sequence lengths (a Python loop would be unrolled: its program grows with n).  The
sizes are chosen so that every loop runs several times at the larger one (blockwise
exact: 512-key blocks on the CPU; chunked forms: 16-64 tokens per chunk; the causal
kernel forms' states between chunks, a loop past 16 chunks on a CPU, loop at both).  Only
lowering runs here (no XLA compile): seconds for the whole file.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import arrayattn
from arrayattn import reference

jax = pytest.importorskip("jax")
jnp = jax.numpy

RECORDS = arrayattn.variants()
IDS = [r.name for r in RECORDS]
SIZES = (2048, 8192)
#: Growth allowed between the two sizes: a shape-dependent branch (a padding concat, the
#: permutation that puts sparse groups back in order) adds a few to a few dozen
#: operations; a loop unrolled 4x more at least doubles the program.
SLACK, GROWTH = 8, 1.1


def op_count(lowered) -> int:
    """StableHLO operations of a lowered program (the lines that define or run one)."""
    return sum(1 for line in lowered.as_text().splitlines()
               if re.search(r"= (stablehlo|chlo|mhlo|func)\.|^\s*(stablehlo|func)\.", line))


def _ops(fn, *shapes) -> int:
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return op_count(jax.jit(fn).lower(*args))


def _assert_flat(counts):
    assert counts[1] <= GROWTH * counts[0] + SLACK, (
        f"the lowered program grows with n: {counts[0]} ops at n={SIZES[0]}, "
        f"{counts[1]} at n={SIZES[1]} (a Python loop over the sequence is unrolled)")


#: Loops that are not scans yet (issue #26 stays open for them).
OPEN: dict = {}


@pytest.mark.parametrize("rec", [pytest.param(r, marks=pytest.mark.xfail(
    strict=True, reason=OPEN[r.name])) if r.name in OPEN else r for r in RECORDS], ids=IDS)
def test_every_variant(rec):
    """Each registered variant's uniform call, causal where it can be (the chunked and
    recurrent loops are there), at two lengths."""
    opts = {"causal": True} if rec.causal else {}
    _assert_flat([_ops(lambda q, k, v: rec(q, k, v, **opts), *[(1, 2, n, 16)] * 3)
                   for n in SIZES])


#: The loops that the uniform calls do not reach with their defaults.
FORMS = {
    "gla recurrent": lambda q, k, v: arrayattn.gla_attention(
        q, k, v, -jnp.abs(q) * 0.1, method="recurrent"),
    "gated deltanet recurrent": lambda q, k, v: arrayattn.gated_delta_attention(
        q, k, v, jax.nn.sigmoid(q[..., 0]), -jnp.abs(k[..., 0]), method="recurrent"),
    "linear attention recurrent": lambda q, k, v: arrayattn.linear_attention(
        q, k, v, causal=True, method="recurrent"),
    "gated rfa recurrent": lambda q, k, v: arrayattn.rfa_attention(
        q, k, v, causal=True, gate=jax.nn.sigmoid(q[..., 0]), method="recurrent"),
    "gated rfa chunked": lambda q, k, v: arrayattn.rfa_attention(
        q, k, v, causal=True, gate=jax.nn.sigmoid(q[..., 0])),
    "blockwise window": lambda q, k, v: arrayattn.softmax_attention(
        q, k, v, block_size=256, window=(300, 0), softcap=20.0),
    "blockwise bias": lambda q, k, v: arrayattn.softmax_attention(
        q, k, v, block_size=256, bias=q[..., :1] * k[..., 0][..., None, :]),
}


@pytest.mark.parametrize("name", list(FORMS))
def test_forms(name):
    """The recurrent forms, gated RFA and blockwise exact with options."""
    _assert_flat([_ops(FORMS[name], *[(1, 2, n, 16)] * 3) for n in SIZES])


#: Block-sparse calls whose scanned plan runs in several chunks and parts under a small
#: memory budget (:func:`test_sparse_chunks_and_parts`).
SPARSE = {
    "bigbird": lambda q, k, v: arrayattn.get_variant("bigbird")(q, k, v, causal=True),
    "strided": lambda q, k, v: arrayattn.get_variant("strided")(q, k, v, causal=True),
    "poolingformer": lambda q, k, v: arrayattn.get_variant("poolingformer")(q, k, v),
    "local bias key mask": lambda q, k, v: arrayattn.local_attention(
        q, k, v, window=40, block_size=16, bias=q[..., :1] * k[..., 0][..., None, :],
        key_mask=k[..., 1] > 0),
}


@pytest.mark.parametrize("name", list(SPARSE))
def test_sparse_chunks_and_parts(name, monkeypatch):
    """The scanned block-sparse executor with a budget of a few key blocks: every group
    of its plan is a scan over many chunks of query blocks and, inside, over parts of
    their key blocks (merged by log-sum-exp) -- still one loop body each."""
    monkeypatch.setattr(arrayattn.core.devices, "CPU_CHUNK", 1 << 12)
    _assert_flat([_ops(SPARSE[name], *[(1, 2, n, 16)] * 3) for n in SIZES])


def test_lsh_blocks_of_chunks(monkeypatch):
    """LSH's blocks of chunks (one chunk per block here) scan too, as do its rounds."""
    import arrayattn.reference.lsh as lsh_module

    monkeypatch.setattr(lsh_module, "_TILE", 1)
    rec = arrayattn.get_variant("lsh")
    _assert_flat([_ops(lambda q, k, v: rec(q, k, v), *[(1, 2, n, 16)] * 3)
                  for n in (256, 1024)])


def test_pinv_iterations():
    """Razavi's iterations are one loop body whatever their number."""
    counts = [_ops(lambda a: reference.pinv_razavi(a, iters), (2, 32, 32)) for iters in (6, 24)]
    _assert_flat(counts)


def test_sizes_exercise_the_loops():
    """The sizes above do run the loops several times (else the test proves nothing):
    blockwise exact's CPU block is 512, so 4 and 16 query blocks; causal kernel forms'
    64-token chunks, 32 and 128 (``running_sum`` loops past 16)."""
    from arrayattn.core.devices import CPU_BLOCK

    assert SIZES[0] >= 2 * CPU_BLOCK and SIZES[1] >= 4 * SIZES[0] // 2
    assert SIZES[0] // 64 > 16
    q = np.zeros((1, 2, SIZES[0], 16), np.float32)
    assert arrayattn.get_variant("softmax_blockwise")(q, q, q).shape == q.shape


@pytest.mark.parametrize("name, sizes", [("strided", (1024, 4096)), ("fixed", (1024, 16384)),
                                         ("lsh", (1024, 16384))])
def test_loops_that_a_budget_adds_are_there_at_every_n(name, sizes):
    """At the benchmark's ``(1, 8, n, 64)`` a strided or fixed row fits the chunk budget
    at n = 1024 and not at the larger size, and LSH's chunks fit one block of the tile.
    The programs keep the loop at both -- strided and fixed rows in merged parts
    (``sparse.executor.SHORT_ROW``), LSH in two blocks at least -- so they are the same
    program; they used to gain the loop (strided 163 -> 241 operations, LSH 392 -> 440)."""
    rec = arrayattn.get_variant(name)
    counts = [_ops(lambda q, k, v: rec(q, k, v), *[(1, 8, n, 64)] * 3) for n in sizes]
    assert counts[0] == counts[1], counts
