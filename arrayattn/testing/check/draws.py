"""The same ``seed``, the same cases: Hypothesis's draws made independent of the modules
imported.

Hypothesis (6.131 and later) mixes "constants from the local source" into its draws: with
probability 0.05 an integer draw returns an integer literal found in any *local* module
loaded so far (a module outside site-packages and the standard library: the kernel's own
module, arrayattn in a checkout, a user's script).  The pool grows as modules are imported,
so the same seed drew different cases through ``arrayattn check`` and through
:func:`~arrayattn.testing.check_kernel`, or after one more ``import``.  The checker's search
runs with that pool empty (:func:`local_constants_off`); Hypothesis's fixed pool of global
constants (0, 1, powers of two ...) is kept, and the user's own Hypothesis tests, outside
the search, keep the local constants.

Example
-------
>>> from arrayattn.testing.check.draws import local_constants_off
>>> with local_constants_off() as active:
...     pass                     # Hypothesis draws here ignore the modules imported
>>> active in (True, False)      # False: a Hypothesis without local constants
True
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["local_constants_off"]

_lock = threading.RLock()
_depth = [0]


def _providers():
    """Hypothesis's provider module when it has the local-constants hook, else None (an
    older Hypothesis without local constants, or one that moved the hook)."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        return None
    if not callable(getattr(providers, "_get_local_constants", None)):
        return None
    return providers


def _clear_cache(providers) -> None:
    """Forget the constants already filtered per draw kind (they include the local ones)."""
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    inner = getattr(cache, "cache", None)
    if hasattr(inner, "clear"):
        inner.clear()


def _empty():
    """An empty pool of local constants (the type Hypothesis returns)."""
    try:
        from hypothesis.internal.constants_ast import Constants
        return Constants()
    except Exception:  # the class moved: an object with no constants of any kind
        class _NoConstants:
            def set_for_type(self, _kind):
                return ()

            def __len__(self):
                return 0
        return _NoConstants()


@contextmanager
def local_constants_off():
    """Within the block, Hypothesis draws no constants of the local source (it yields True
    when it switched them off, False when this Hypothesis has none to switch off).

    The switch replaces ``hypothesis.internal.conjecture.providers._get_local_constants``
    (looked up by name at every test case) with a function returning an empty pool, and
    clears the cache of constants filtered per draw kind on the way in and out; the
    original function is put back on exit, also after an exception.  Reentrant; process
    wide while active (another thread's Hypothesis tests running at the same moment would
    also see no local constants)."""
    providers = _providers()
    if providers is None:
        yield False
        return
    with _lock:
        if _depth[0] == 0:
            original = providers._get_local_constants
            empty = _empty()
            providers._get_local_constants = lambda: empty
            _clear_cache(providers)
        _depth[0] += 1
    try:
        yield True
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                providers._get_local_constants = original
                _clear_cache(providers)
