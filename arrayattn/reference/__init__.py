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
from . import finite
from . import masks
from . import rows
from . import chunks
from . import scan
from . import indexing
from . import exact
from . import exact_vjp
from . import kernel
from . import kernel_vjp
from . import performer
from . import performer_vjp
from . import rfa
from . import rfa_vjp
from . import gated
from . import gated_vjp
from . import delta_vjp
from . import nystrom
from . import nystrom_vjp
from . import linformer
from . import linformer_vjp
from . import luna
from . import luna_vjp
from . import sparse
from . import sparse_vjp
from . import pooling
from . import pooling_vjp
from . import lsh
from . import lsh_vjp

from .finite import *  # noqa: F401,F403
from .masks import *  # noqa: F401,F403
from .rows import *  # noqa: F401,F403
from .chunks import *  # noqa: F401,F403
from .exact import *  # noqa: F401,F403
from .exact_vjp import *  # noqa: F401,F403
from .kernel import *  # noqa: F401,F403
from .kernel_vjp import *  # noqa: F401,F403
from .performer import *  # noqa: F401,F403
from .performer_vjp import *  # noqa: F401,F403
from .rfa import *  # noqa: F401,F403
from .rfa_vjp import *  # noqa: F401,F403
from .gated import *  # noqa: F401,F403
from .gated_vjp import *  # noqa: F401,F403
from .delta_vjp import *  # noqa: F401,F403
from .nystrom import *  # noqa: F401,F403
from .nystrom_vjp import *  # noqa: F401,F403
from .linformer import *  # noqa: F401,F403
from .linformer_vjp import *  # noqa: F401,F403
from .luna import *  # noqa: F401,F403
from .luna_vjp import *  # noqa: F401,F403
from .sparse import *  # noqa: F401,F403
from .sparse_vjp import *  # noqa: F401,F403
from .pooling import *  # noqa: F401,F403
from .pooling_vjp import *  # noqa: F401,F403
from .lsh import *  # noqa: F401,F403
from .lsh_vjp import *  # noqa: F401,F403

__all__ = [
    *finite.__all__,
    *masks.__all__,
    *rows.__all__,
    *exact.__all__,
    *exact_vjp.__all__,
    *kernel.__all__,
    *kernel_vjp.__all__,
    *performer.__all__,
    *performer_vjp.__all__,
    *rfa.__all__,
    *rfa_vjp.__all__,
    *gated.__all__,
    *gated_vjp.__all__,
    *delta_vjp.__all__,
    *nystrom.__all__,
    *nystrom_vjp.__all__,
    *linformer.__all__,
    *linformer_vjp.__all__,
    *luna.__all__,
    *luna_vjp.__all__,
    *sparse.__all__,
    *sparse_vjp.__all__,
    *pooling.__all__,
    *pooling_vjp.__all__,
    *lsh.__all__,
    *lsh_vjp.__all__,
]
