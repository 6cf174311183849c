"""The kernel checker (``arrayattn check``, issue #41): search for a case where a kernel
disagrees with arrayattn's reference -- a fixed catalogue of edge cases, random draws
(Hypothesis), shrinking to the smallest failing case -- and write the repro file that
``arrayattn validate`` judges on its own.

- :mod:`.conventions` -- one adapter per calling convention; :mod:`.cases` -- the case
  record, the catalogue and the strategies; :mod:`.search` -- the search; :mod:`.judge`
  -- the only caller of the referee; :mod:`.repro` -- the repro file; :mod:`.api` --
  :func:`check_kernel`; :mod:`.command` -- the ``check`` subcommand.
"""
from __future__ import annotations

from .api import KernelCheck, assert_kernel_conforms, check_kernel
from .conventions import CONVENTIONS, Custom, get_convention

__all__ = ["check_kernel", "assert_kernel_conforms", "KernelCheck", "CONVENTIONS", "Custom",
           "get_convention"]
