"""The reference forms: every variant once, shaped like its paper's equation.

Array API only (it imports nothing of the engines: a test enforces it), always
max-shifted, no host reads (every form traces under ``jax.jit``), no in-place updates, no
``eps`` added, and ``O((n + s) m)`` memory where the maths allows.  These are what the
docs show, what :mod:`arrayattn.testing` validates against (in float64), and what every
engine is tested against.

The forms take validated inputs in their working dtype (the public functions of
:mod:`arrayattn` validate, choose the implementation and cast back); each is a plain
function that can be read -- and called -- on its own.
"""
from . import masks, exact, exact_vjp, scan, kernel, performer, rfa, gated, nystrom, nystrom_vjp, linformer, luna, sparse, sparse_vjp, pooling, pooling_vjp, lsh, lsh_vjp
from .masks import *  # noqa: F401,F403
from .exact import *  # noqa: F401,F403
from .exact_vjp import *  # noqa: F401,F403
from .kernel import *  # noqa: F401,F403
from .performer import *  # noqa: F401,F403
from .rfa import *  # noqa: F401,F403
from .gated import *  # noqa: F401,F403
from .nystrom import *  # noqa: F401,F403
from .nystrom_vjp import *  # noqa: F401,F403
from .linformer import *  # noqa: F401,F403
from .luna import *  # noqa: F401,F403
from .sparse import *  # noqa: F401,F403
from .sparse_vjp import *  # noqa: F401,F403
from .pooling import *  # noqa: F401,F403
from .pooling_vjp import *  # noqa: F401,F403
from .lsh import *  # noqa: F401,F403
from .lsh_vjp import *  # noqa: F401,F403

__all__ = [
    *masks.__all__,
    *exact.__all__,
    *exact_vjp.__all__,
    *kernel.__all__,
    *performer.__all__,
    *rfa.__all__,
    *gated.__all__,
    *nystrom.__all__,
    *nystrom_vjp.__all__,
    *linformer.__all__,
    *luna.__all__,
    *sparse.__all__,
    *sparse_vjp.__all__,
    *pooling.__all__,
    *pooling_vjp.__all__,
    *lsh.__all__,
    *lsh_vjp.__all__,
]
