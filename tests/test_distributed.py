"""arrayattn.distributed on 4 host devices (``XLA_FLAGS=--xla_force_host_platform_device_count
=4``), each check in a subprocess so that this process's JAX keeps its own devices:
batch/head sharding of registered variants, ring attention and sequence-parallel causal
linear attention equal the single-device results; the docs page's example runs."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("jax")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F32 = 2.0 ** -23


def run_on_4_devices(code: str, x64: bool = False) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get(
                   "PYTHONPATH", ""), JAX_ENABLE_X64="1" if x64 else "0")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


SETUP = """
import json, numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
import arrayattn
from arrayattn.distributed import sharded, ring_attention, sequence_parallel_linear_attention
assert len(jax.devices()) == 4, jax.devices()
rng = np.random.default_rng(0)
def qkv(shape, dtype, norm=None):
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    if norm:
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) * norm for x in (q, k))
    return [jnp.asarray(x, dtype=dtype) for x in (q, k, v)]
def err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(1.0, np.abs(b).max()))
"""


def test_batch_head_sharding_equals_one_device():
    out = run_on_4_devices(SETUP + """
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("batch", "heads"))
q, k, v = qkv((2, 4, 64, 16), jnp.float32, norm=6.0)
res = {}
for name in ("softmax", "linear_elu", "performer_positive", "nystrom_iterative", "local",
             "gla"):
    rec = arrayattn.get_variant(name)
    got = sharded(name, mesh)(q, k, v)
    res[name] = [err(got, rec(q, k, v)), str(got.sharding.spec),
                 len(got.sharding.device_set)]
print(json.dumps(res))
""")
    for name, (e, spec, ndev) in out.items():
        # heads are independent: the same computation per head, so float32 rounding of
        # the sums of at most n = 64 terms
        assert e < 64 * 64 * F32, (name, e)
        assert ndev == 4 and "batch" in spec and "heads" in spec, (name, spec)


@pytest.mark.parametrize("x64", [False, True])
def test_ring_and_sequence_parallel_equal_one_device(x64):
    out = run_on_4_devices(SETUP + """
dt = jnp.float64 if jax.config.jax_enable_x64 else jnp.float32
mesh = Mesh(np.array(jax.devices()), ("seq",))
q, k, v = qkv((2, 3, 128, 16), dt, norm=8.0)
res = {}
for causal in (False, True):
    got = ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=causal)
    res[f"ring causal={causal}"] = [err(got, arrayattn.softmax_attention(q, k, v, causal=causal)),
                                    str(got.sharding.spec)]
got = sequence_parallel_linear_attention(q, k, v, mesh=mesh, axis_name="seq", chunk_size=16)
res["linear"] = [err(got, arrayattn.linear_attention(q, k, v, causal=True)),
                 str(got.sharding.spec)]
print(json.dumps(res))
""", x64=x64)
    eps = 2.0 ** -52 if x64 else F32
    for name, (e, spec) in out.items():
        # a different summation order (blocks of 32 merged by log-sum-exp, or states
        # summed per device): rounding of sums of n = 128 terms, sharp logits
        assert e < 128 * 64 * eps, (name, e)
        assert "seq" in spec, (name, spec)


def test_errors_without_devices():
    import numpy as np
    import jax
    from jax.sharding import Mesh
    from arrayattn.distributed import ring_attention
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    q = np.ones((2, 6, 4), np.float32)
    with pytest.raises(ValueError, match="n == s"):
        ring_attention(q, q[:, :4], q[:, :4], mesh=mesh, axis_name="seq")


def test_scaling_page_example_runs():
    """The code block of docs/scaling.rst, verbatim, on 4 host devices."""
    page = open(os.path.join(ROOT, "docs", "scaling.rst"), encoding="utf-8").read()
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:   .*\n|\n)+)", page)
    assert blocks, "docs/scaling.rst has no python code block"
    code = "\n".join(line[3:] for line in blocks[0].splitlines())
    out = run_on_4_devices(code + "\nimport json; print(json.dumps({'ok': True}))")
    assert out == {"ok": True}
