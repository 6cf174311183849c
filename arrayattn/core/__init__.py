"""The core every public function runs on: the one call pipeline and the plumbing under it.

- :mod:`.pipeline` -- ``run(spec, q, k, v, **options)``: check once, cast, take out
  non-finite keys, choose the implementation, cast back;
- :mod:`.engine` -- the engine setting (``use_engine``) and the namespace entry;
- :mod:`.checks` -- the checks shared by every call (``q, k, v``, masks, scale, seeds);
- :mod:`.xp` -- array-API helpers; :mod:`.devices` -- sizes chosen per device;
  :mod:`.precision` -- full float32 precision for a call; :mod:`.heads` -- grouped-query
  heads.

It imports only the reference forms (:mod:`arrayattn.reference`) and the NumPy engine
(:mod:`arrayattn._numpy`); every family builds on it.
"""

__all__: list[str] = []
