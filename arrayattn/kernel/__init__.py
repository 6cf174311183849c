"""Kernel (linear) attention: ``phi(q) (phi(k)^T v) / phi(q) (phi(k)^T 1)``.

- :mod:`.linear` -- :func:`~arrayattn.linear_attention`,
  :func:`~arrayattn.feature_attention`, :func:`~arrayattn.efficient_attention`;
- :mod:`.feature_maps` -- the feature maps (``elu+1``, ``relu``, ``cosine``, ``taylor``
  and a caller's own);
- :mod:`.decoding` and :mod:`.state` -- the recurrent state and the one-token steps;
- :mod:`.run` -- the family's pipeline steps; :mod:`.checks` and :mod:`.calls` -- its
  argument checks and call records.
"""

__all__: list[str] = []
