"""Stand-ins for xFormers' ``attn_bias`` classes (``xformers.ops.fmha.attn_bias``), so that
the ``xformers`` convention runs without xFormers installed (its kernels need CUDA).

Each class mirrors the real one's name, base class, fields and ``materialize(shape, dtype,
device)`` (the additive ``0 / -inf`` bias ``(..., M, N)``), so a pure-torch kernel written
against the real classes (reading ``type(b).__name__``, ``window_left``,
``q_seqinfo.seqstart_py`` ...) runs unchanged on these.  :func:`make_bias` builds either
family: ``make_bias(kind, namespace=xformers.ops.fmha.attn_bias, ...)`` builds the real ones.

The semantics (xFormers' docstrings and ``materialize``), with ``i`` a query row, ``j`` a
key, ``M`` queries and ``N`` keys, ``shift = N - M``:

- ``LowerTriangularMask``: ``j <= i`` (causal, top-left);
- ``LowerTriangularFromBottomRightMask``: ``j <= i + shift`` (bottom-right);
- ``LowerTriangularFromBottomRightLocalAttentionMask(_window_size=w)``:
  ``i + shift - w < j <= i + shift``;
- ``LocalAttentionFromBottomRightMask(window_left, window_right)``:
  ``i + shift - window_left <= j <= i + shift + window_right``;
- ``LowerTriangularMaskWithTensorBias(bias)``: ``LowerTriangularMask`` plus ``bias``
  (``LowerTriangularMask().add_bias(bias)``);
- ``BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen)``: a packed batch of one; query
  block ``b`` sees key block ``b`` only; ``BlockDiagonalCausalMask``: each block causal
  top-left; ``BlockDiagonalCausalFromBottomRightMask``: bottom-right (``kv >= q`` per
  block).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

__all__ = ["AttentionBias", "LowerTriangularMask", "LowerTriangularMaskWithTensorBias",
           "LowerTriangularFromBottomRightMask",
           "LowerTriangularFromBottomRightLocalAttentionMask",
           "LocalAttentionFromBottomRightMask", "BlockDiagonalMask", "BlockDiagonalCausalMask",
           "BlockDiagonalCausalFromBottomRightMask", "make_bias", "KINDS"]


def _causal(shape, dtype, device, *, window=None, bottom_right=False):
    import torch
    m, n = shape[-2:]
    shift = n - m if bottom_right else 0
    i = torch.arange(m, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    keep = j <= i + shift
    if window is not None:
        keep &= j > i + shift - window
    return _additive(keep, shape, dtype)


def _additive(keep, shape, dtype):
    import torch
    bias = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device)
    bias = bias.masked_fill(~keep, -math.inf).to(dtype)
    return bias.expand(shape)


class AttentionBias:
    """Base of the bias classes (``materialize`` raises, as xFormers')."""

    def materialize(self, shape, dtype=None, device="cpu"):
        raise NotImplementedError


class LowerTriangularMask(AttentionBias):
    """Causal, top-left: query ``i`` sees keys ``j <= i``."""

    def __init__(self, device=None) -> None:
        """``device`` unused (as xFormers')."""

    def materialize(self, shape, dtype=None, device="cpu"):
        return _causal(shape, dtype or _f32(), device)

    def add_bias(self, bias) -> "LowerTriangularMaskWithTensorBias":
        return LowerTriangularMaskWithTensorBias(bias)


class LowerTriangularMaskWithTensorBias(LowerTriangularMask):
    """:class:`LowerTriangularMask` plus the additive tensor ``_bias`` ``(B, H, M, N)``."""

    def __init__(self, bias) -> None:
        self._bias = bias

    def materialize(self, shape, dtype=None, device="cpu"):
        return super().materialize(shape, dtype, device) + self._bias


class LowerTriangularFromBottomRightMask(AttentionBias):
    """Causal, bottom-right: query ``i`` sees keys ``j <= i + N - M``."""

    def materialize(self, shape, dtype=None, device="cpu"):
        return _causal(shape, dtype or _f32(), device, bottom_right=True)

    def make_local_attention(self, window_size: int):
        return LowerTriangularFromBottomRightLocalAttentionMask(window_size)


@dataclass
class LowerTriangularFromBottomRightLocalAttentionMask(LowerTriangularFromBottomRightMask):
    """Bottom-right causal within a window: ``i + N - M - _window_size < j <= i + N - M``."""

    _window_size: int

    def __post_init__(self) -> None:
        if self._window_size <= 0:
            raise ValueError(f"Expected `window_size > 0`, but window_size={self._window_size}")

    def materialize(self, shape, dtype=None, device="cpu"):
        return _causal(shape, dtype or _f32(), device, window=self._window_size,
                       bottom_right=True)


@dataclass
class LocalAttentionFromBottomRightMask(AttentionBias):
    """``i + N - M - window_left <= j <= i + N - M + window_right``."""

    window_left: int
    window_right: int

    def __post_init__(self) -> None:
        if self.window_left < 0 or self.window_right < 0:
            raise ValueError("window_left and window_right must be >= 0; got "
                             f"{self.window_left}, {self.window_right}")

    def materialize(self, shape, dtype=None, device="cpu"):
        import torch
        m, n = shape[-2:]
        i = torch.arange(m, device=device)[:, None] + (n - m)
        j = torch.arange(n, device=device)[None, :]
        keep = (j >= i - self.window_left) & (j <= i + self.window_right)
        return _additive(keep, shape, dtype or _f32())


@dataclass
class _SeqLenInfo:
    """The division of the packed tokens into blocks (xFormers' field names)."""

    seqstart: object
    max_seqlen: int
    min_seqlen: int
    seqstart_py: list

    @classmethod
    def from_seqlens(cls, seqlens, *, device=None) -> "_SeqLenInfo":
        import torch
        lens = [int(x) for x in seqlens]
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        return cls(torch.tensor(starts, dtype=torch.int32, device=device or "cpu"),
                   max(lens, default=0), min(lens, default=0), starts)

    def intervals(self):
        yield from zip(self.seqstart_py, self.seqstart_py[1:])


@dataclass
class BlockDiagonalMask(AttentionBias):
    """A packed batch of one: query block ``b`` sees key block ``b`` only."""

    q_seqinfo: _SeqLenInfo
    k_seqinfo: _SeqLenInfo
    _batch_sizes: object = None

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):
        q = _SeqLenInfo.from_seqlens(q_seqlen, device=device)
        k = q if kv_seqlen is None else _SeqLenInfo.from_seqlens(kv_seqlen, device=device)
        return cls(q_seqinfo=q, k_seqinfo=k)

    def _block(self, m, n, device):
        import torch
        return torch.ones(m, n, dtype=torch.bool, device=device)

    def materialize(self, shape, dtype=None, device="cpu"):
        import torch
        keep = torch.zeros(shape[-2:], dtype=torch.bool, device=device)
        for (q0, q1), (k0, k1) in zip(self.q_seqinfo.intervals(), self.k_seqinfo.intervals()):
            keep[q0:q1, k0:k1] = self._block(q1 - q0, k1 - k0, device)
        return _additive(keep, shape, dtype or _f32())

    def make_causal(self):
        return BlockDiagonalCausalMask(self.q_seqinfo, self.k_seqinfo, self._batch_sizes)

    def make_causal_from_bottomright(self):
        return BlockDiagonalCausalFromBottomRightMask(self.q_seqinfo, self.k_seqinfo,
                                                      self._batch_sizes)


@dataclass
class BlockDiagonalCausalMask(BlockDiagonalMask):
    """Each block causal, top-left."""

    def _block(self, m, n, device):
        return _causal((m, n), None, device).isfinite()


@dataclass
class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
    """Each block causal, bottom-right (each block needs ``kv >= q``)."""

    def __post_init__(self) -> None:
        for b, ((q0, q1), (k0, k1)) in enumerate(zip(self.q_seqinfo.intervals(),
                                                     self.k_seqinfo.intervals())):
            if k1 - k0 < q1 - q0:
                raise ValueError(f"Block #{b} has num_keys={k1 - k0} and "
                                 f"num_queries={q1 - q0}. Expected `num_keys >= num_queries`")

    def _block(self, m, n, device):
        return _causal((m, n), None, device, bottom_right=True).isfinite()


def _f32():
    import torch
    return torch.float32


#: The bias kinds of the ``xformers`` convention (``"tensor"``: a plain tensor bias).
KINDS = ("LowerTriangularMask", "LowerTriangularFromBottomRightMask",
         "LowerTriangularFromBottomRightLocalAttentionMask",
         "LocalAttentionFromBottomRightMask", "LowerTriangularMaskWithTensorBias", "tensor",
         "BlockDiagonalMask", "BlockDiagonalCausalMask",
         "BlockDiagonalCausalFromBottomRightMask")


def make_bias(kind: str, *, namespace=None, device="cpu", bias=None, window_size=None,
              window_left=None, window_right=None, q_seqlen=None, kv_seqlen=None):
    """The ``attn_bias`` of one ``kind`` (:data:`KINDS`) from the classes of ``namespace``
    (this module by default; ``xformers.ops.fmha.attn_bias`` for the real ones), built as a
    user builds it: ``LowerTriangularMask()``, ``LowerTriangularMask().add_bias(bias)``,
    ``LocalAttentionFromBottomRightMask(window_left=, window_right=)``,
    ``BlockDiagonalMask.from_seqlens(q_seqlen, kv_seqlen)``; ``"tensor"`` is ``bias``."""
    ns = sys.modules[__name__] if namespace is None else namespace
    if kind == "tensor":
        return bias
    if kind == "LowerTriangularMaskWithTensorBias":
        return ns.LowerTriangularMask().add_bias(bias)
    cls = getattr(ns, kind)
    if kind == "LowerTriangularFromBottomRightLocalAttentionMask":
        return cls(window_size)
    if kind == "LocalAttentionFromBottomRightMask":
        return cls(window_left=window_left, window_right=window_right)
    if kind.startswith("BlockDiagonal"):
        import torch      # xFormers compares the device with torch.device("cpu")
        return cls.from_seqlens(list(q_seqlen), list(kv_seqlen), device=torch.device(device))
    return cls()
