"""The gated and delta-rule family: RetNet retention, GLA, Mamba-2 SSD, DeltaNet and gated
DeltaNet.

- :mod:`.api` -- the public functions; :mod:`.step` -- the one-token decoding step;
- :mod:`.run` -- the family's pipeline steps; :mod:`.draws` -- the gates the library
  draws itself (seeded); :mod:`.checks` -- the argument checks and the call record.
"""

__all__: list[str] = []
