"""Exact softmax attention: the family every other one approximates.

- :mod:`.softmax` -- :func:`~arrayattn.softmax_attention`, dense and blockwise, with
  FlashAttention's and FlexAttention's options;
- :mod:`.paged` -- :func:`~arrayattn.paged_attention` over a paged KV cache;
- :mod:`.checks` -- the checks of exact attention's options (the call record).
"""

__all__: list[str] = []
