"""Full float32 matmul precision inside every call, whatever the backend's default
(:mod:`arrayattn.core.precision`).  The GPU effect is measured by hand on the GPU machine;
here the mechanism: what the switches are inside a call and after it."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn.core.precision import full_precision


def test_jax_highest_inside_a_call_and_under_the_users_jit():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    seen = []

    def phi(x):
        seen.append(jax.config.jax_default_matmul_precision)
        return jnp.exp(x)

    q = jnp.ones((4, 8), dtype=jnp.float32)
    arrayattn.linear_attention(q, q, q, feature_map=(phi, phi))
    assert seen and all(p == "highest" for p in seen)
    assert jax.config.jax_default_matmul_precision != "highest"     # restored
    lowered = jax.jit(lambda a: arrayattn.softmax_attention(a, a, a)).lower(q).as_text()
    assert "HIGHEST" in lowered.upper()


def test_jax_opt_in(monkeypatch):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    monkeypatch.setenv("ARRAYATTN_ALLOW_TF32", "1")
    with full_precision(jnp):
        assert jax.config.jax_default_matmul_precision != "highest"


@pytest.mark.parametrize("fail", [False, True])
def test_torch_switches_off_inside_and_restored(monkeypatch, fail):
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # the CUDA branch
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")                       # a user's TF32
    try:
        with pytest.raises(RuntimeError) if fail else _nothing():
            with full_precision(xp):
                assert torch.get_float32_matmul_precision() == "highest"
                assert not torch.backends.cuda.matmul.allow_tf32
                if fail:
                    raise RuntimeError("inside")
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_torch_cpu_untouched():
    torch = pytest.importorskip("torch")
    import array_api_compat.torch as xp
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with full_precision(xp):
        pass   # no switch touched, no lock taken


def test_numpy_and_strict_untouched():
    import array_api_compat.numpy as xp
    with full_precision(xp):
        pass


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class TestDeviceDefaults:
    def test_cpu_arrays(self):
        from arrayattn.core.devices import default_block_size, device_kind
        assert device_kind(np.ones(2)) == "cpu" and default_block_size(np.ones(2)) == 512
        torch = pytest.importorskip("torch")
        assert device_kind(torch.ones(2)) == "cpu"

    def test_gpu_branch(self, monkeypatch):
        """A CUDA tensor's kind, without a GPU: a stand-in with ``device.type``."""
        import array_api_compat
        from arrayattn.core import devices as _devices

        class Cuda:
            class device:
                type = "cuda"
        monkeypatch.setattr(array_api_compat, "is_torch_array", lambda x: isinstance(x, Cuda))
        assert _devices.device_kind(Cuda()) == "gpu"
        assert _devices.default_block_size(Cuda()) == _devices.GPU_BLOCK

    def test_auto_block_equals_explicit(self, rng):
        q, k, v = (rng.standard_normal((2, 600, 8)) for _ in range(3))
        np.testing.assert_array_equal(
            arrayattn.softmax_attention(q, k, v, block_size="auto"),
            arrayattn.softmax_attention(q, k, v, block_size=512))
        with pytest.raises(TypeError, match="block_size"):
            arrayattn.softmax_attention(q, k, v, block_size="big")
