"""The NumPy-CPU engine: faster forms of the reference forms for NumPy inputs.

It speaks NumPy plainly (``np.exp(s, out=s)``, ``np.matmul(a, b, out=buf)``), runs
independent row blocks in threads (:mod:`.parallel`) and reuses per-thread scratch
buffers.  A public function picks it once at entry (:func:`arrayattn._engine.numpy_engine`)
for NumPy inputs large enough to pay; every engine is tested equal to its reference form
to rounding, whole and split over threads.  Each engine module's docstring carries its
measured numbers.
"""
__all__: list[str] = []
