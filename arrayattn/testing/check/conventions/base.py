"""What every calling convention shares: the :class:`Call` record (what to pass, how to
judge), the inputs drawn from a case, and running a kernel forward and backward on torch
or JAX."""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

__all__ = ["Call", "Convention", "to_framework", "host", "draw_qkv", "swap", "shape_values",
           "SENTINELS", "VALUE_CLASSES"]


def swap(x: np.ndarray) -> np.ndarray:
    """``(b, h, n, d)`` <-> ``(b, n, h, d)`` (axes -3, -2)."""
    return np.ascontiguousarray(np.swapaxes(x, -3, -2))


@dataclass
class Call:
    """One call of a kernel and how to judge it.

    ``tensors``: the framework arrays by name (q, k, v and the convention's other arrays);
    ``diff``: the names differentiated by the backward; ``variant``, ``profile``,
    ``layout`` and ``params``: the referee's problem for the output (the port's option
    names with a profile, arrayattn's without); ``grad_params``: arrayattn's options for
    :func:`~arrayattn.testing.compare_grads` (``None``: derived from the profile);
    ``state``: the final-state reference's options (fla), ``None`` without one."""

    tensors: dict
    diff: tuple
    variant: str
    profile: str | None
    layout: str
    params: dict
    grad_params: dict | None = None
    state: dict | None = None
    inputs: dict | None = None
    rename: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def host(x) -> np.ndarray:
    """A host float64 copy (integers and booleans as they are) of a torch/JAX array."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if x.dtype.is_floating_point:
            x = x.double()
        return x.numpy()
    a = np.asarray(x)
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a


def to_framework(x: np.ndarray, framework: str, dtype: str, device: str = "cpu"):
    """A host array as a ``dtype`` torch tensor or JAX array (integer and boolean arrays
    keep their kind)."""
    if framework == "torch":
        import torch
        t = torch.from_numpy(np.ascontiguousarray(x))
        if x.dtype.kind == "f":
            t = t.to(getattr(torch, dtype))
        return t.to(device)
    import jax.numpy as jnp
    return jnp.asarray(x, dtype=dtype if x.dtype.kind == "f" else None)


def draw_qkv(case, rng, *, unit_qk: bool = False) -> dict:
    """q, k, v, do in ``(b, h, n, d)``, float64: q and k of ``case.magnitude`` (L2-normalised
    rows with ``unit_qk``), v and do standard normal; q and k then shaped to the case's
    value class (:func:`shape_values`).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing.check.cases import Case
    >>> x = draw_qkv(Case(values="far_below"), np.random.default_rng(0))
    >>> bool((np.einsum("bhid,bhjd->bhij", x["q"], x["k"]) * 16 ** -0.5 < -50).all())
    True
    """
    q = rng.standard_normal((case.b, case.hq, case.n, case.d))
    k = rng.standard_normal((case.b, case.hkv, case.s, case.d))
    if unit_qk:
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    else:
        q, k = q * case.magnitude, k * case.magnitude
    out = {"q": q, "k": k, "v": rng.standard_normal((case.b, case.hkv, case.s, case.dv)),
           "do": rng.standard_normal((case.b, case.hq, case.n, case.dv))}
    values = getattr(case, "values", "normal")
    if values != "normal" and not unit_qk:
        out["q"], out["k"] = shape_values(values, out["q"], out["k"], _scale(case), case.dtype,
                                          rng)
    return out


#: The value classes of softmax conventions (see ``cases.VALUES``).
VALUE_CLASSES = ("normal", "far_below", "far_above", "ties", "dominant", "sentinel", "overflow")
#: The scaled logits of the ``sentinel`` class: the finite values kernels mask or start a
#: running max with (-1e4, -3e4, -5e4, float16's -65504, -1e5).
SENTINELS = (-1e4, -3e4, -5e4, -65504.0, -1e5)
#: The first coordinate of every key of the far classes (a power of two: q.k exact).
_KEY = 256.0


def _scale(case) -> float:
    """The softmax scale the case's kernel applies (its option, else ``d ** -0.5``)."""
    o = case.opts
    return float(o.get("softmax_scale") or o.get("scale") or case.d ** -0.5)


def shape_values(values: str, q, k, scale: float, dtype: str, rng):
    """q, k of the value class ``values`` (see :data:`~arrayattn.testing.check.cases.VALUES`).

    The far classes set the first coordinate of every key to 256 and of query row ``i`` to
    ``t_i / (256 scale)``, the rest a quarter-grid Gaussian: the scaled logits of row ``i``
    are ``t_i`` plus a spread of about one (products and sums exact in float32), with
    ``t_i`` log-uniform in 1e2 .. 1e5 below (``far_below``) or above zero, one of
    :data:`SENTINELS` (``sentinel``), or raw ``|q.k|`` 7e4 .. 3e5 of either sign
    (``overflow``, past float16's 65504 before scaling).  ``ties`` draws every key from
    two rows (exact ties of the logits), ``dominant`` one key per head whose logit exceeds
    the others' by about 30."""
    q, k = q.copy(), k.copy()
    n, s = q.shape[-2], k.shape[-2]
    if values == "ties":
        if s:
            protos = k[..., :2, :] if s >= 2 else k[..., :1, :]
            k = protos[..., rng.integers(0, protos.shape[-2], s), :]
        return q, k
    if values == "dominant":
        if s and q.shape[-1] > 1:
            q[..., 0] = 4.0
            k[..., 0] = 0.0
            j = rng.integers(0, s)
            k[..., j, 0] = 30.0 / (4.0 * scale)
        return q, k
    if values == "overflow" and dtype not in ("float16", "bfloat16"):
        values = "far_above"
    quarter = lambda x: np.round(x * 4.0) / 4.0  # noqa: E731
    q[..., 1:] = quarter(rng.standard_normal(q[..., 1:].shape))
    k[..., 1:] = quarter(rng.standard_normal(k[..., 1:].shape))
    if values in ("far_below", "far_above"):
        t = 10.0 ** rng.uniform(2, 5, n) * (-1 if values == "far_below" else 1)
    elif values == "sentinel":
        t = np.asarray(SENTINELS)[rng.integers(0, len(SENTINELS), n)]
    elif values == "overflow":
        t = 10.0 ** rng.uniform(np.log10(7e4), np.log10(3e5), n) * rng.choice((-1, 1), n) \
            * scale
    else:
        raise ValueError(f"values must be one of normal, far_below, far_above, ties, "
                         f"dominant, sentinel, overflow; got {values!r}")
    if values != "overflow" and dtype in ("float16", "bfloat16"):
        t = np.clip(t, -6e4 * scale, 6e4 * scale)      # raw q.k within float16's range
    k[..., 0] = _KEY
    q[..., 0] = quarter(t / (_KEY * scale))
    return q, k


class Convention:
    """A calling convention: the option ``space`` (name -> values, the first one off),
    ``equal_lengths`` (n == s), ``equal_dims`` (d == dv), ``gqa`` (fewer key/value heads),
    the ``framework`` of the arrays, and :meth:`build` (a case -> a :class:`Call`) and
    :meth:`call` (run the kernel: ``{"out", "lse", "final_state"}`` as it returns them)."""

    name = ""
    framework = "torch"
    equal_lengths = False
    equal_dims = False
    gqa = True
    space: dict = {}
    #: the convention's own signature, for the docs table
    signature = ""
    device = "cpu"
    #: the value classes drawn (softmax conventions: all of ``cases.VALUES``)
    values = ("normal",)

    def poison_regions(self, case) -> tuple:
        """The names of the regions of slots a correct kernel never reads (poisoned by
        ``case.poison``); none by default."""
        return ()

    def normalize(self, case):
        """The case made valid for this convention (options that cannot combine dropped)."""
        return case

    def build(self, case) -> Call:  # pragma: no cover - abstract
        raise NotImplementedError

    def call(self, fn, t: dict, case) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def to_judge(self, name: str, x: np.ndarray) -> np.ndarray:
        """A result or gradient (any library) in the layout the referee reads (``Call.layout``)."""
        return x

    def tensors(self, arrays: dict, case) -> dict:
        """Host arrays -> framework arrays in the case's dtype (on ``self.device``)."""
        return {k: to_framework(a, self.framework, case.dtype, self.device) if isinstance(
            a, np.ndarray) else a for k, a in arrays.items()}

    def run(self, fn, call: Call, case, backward: bool) -> tuple[dict, dict]:
        """``(results, gradients)``: the kernel's outputs (host float64) and, with
        ``backward``, the gradients of ``<do, out>`` for ``call.diff``."""
        t = dict(call.tensors)
        do = t.pop("do")
        if not backward:
            return _detached(self.call(fn, t, case)), {}
        if self.framework == "torch":
            return self._torch_backward(fn, t, do, call.diff, case)
        return self._jax_backward(fn, t, do, call.diff, case)

    def _torch_backward(self, fn, t, do, diff, case):
        for name in diff:
            t[name] = t[name].detach().clone().requires_grad_(True)
        res = self.call(fn, t, case)
        res["out"].backward(do)
        missing = [name for name in diff if t[name].grad is None]
        if missing:
            raise RuntimeError(f"the backward gave no gradient for {', '.join(missing)}")
        return _detached(res), {name: t[name].grad for name in diff}

    def _jax_backward(self, fn, t, do, diff, case):
        import jax

        def forward(*values):
            return self.call(fn, {**t, **dict(zip(diff, values))}, case)["out"]

        out, pull = jax.vjp(forward, *(t[name] for name in diff))
        res = _detached(self.call(fn, t, case))
        res["out"] = out
        return res, dict(zip(diff, pull(do)))


def _detached(res: dict) -> dict:
    return {k: v.detach() if hasattr(v, "detach") else v for k, v in res.items()
            if v is not None}
