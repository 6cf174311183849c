"""The NumPy-CPU engine: faster forms of the reference forms for NumPy inputs.

It speaks NumPy plainly (``np.exp(s, out=s)``, ``np.matmul(a, b, out=buf)``), runs
independent row blocks in threads (:mod:`.parallel`) and reuses per-thread scratch
buffers.  The call pipeline picks it once per call (:func:`arrayattn.core.pipeline.implementation`)
for NumPy inputs large enough to pay; every engine is tested equal to its reference form
to rounding, whole and split over threads.  Each engine module's docstring carries its
measured numbers.  Its process lock stays here: callers hold it through
:func:`serialised`.
"""
from .parallel import serialised

__all__ = ["serialised"]
