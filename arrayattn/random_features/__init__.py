"""Random-feature attention: softmax attention through random features.

- :mod:`.performer` -- Performer / FAVOR+ (and FAVOR++);
- :mod:`.rfa` -- Random Feature Attention, with its optional gate;
- :mod:`.projection` -- the random projection (:class:`~arrayattn.RandomFeatures`), drawn
  on the host; :mod:`.kinds` -- the feature kinds; :mod:`.estimates` -- the kernel
  estimates and their variance;
- :mod:`.calls` -- the argument checks and call records of Performer and RFA.

Built on :mod:`arrayattn.kernel` (the feature form and its engine).
"""

__all__: list[str] = []
