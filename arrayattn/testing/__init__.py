"""Testing helpers for arrayattn and for people validating their own kernels: assertions, the
output, log-sum-exp and gradient referees, the port profiles, and the kernel checker
(:func:`check_kernel`, ``arrayattn check``)."""
from __future__ import annotations

from .check import KernelCheck, assert_kernel_conforms, check_kernel
from .assertions import (check_tolerance, default_tolerance, xp_assert_close, xp_assert_equal,
                         xp_assert_kind)
from .comparison import Comparison
from .grads import GradComparison, assert_grads_match, compare_grads
from . import plain
from .measures import EPS, TOLERANCE_FACTOR, round_to
from .outputs import RULES, assert_matches_reference, compare_lse, compare_to_reference
from .problem import LAYOUTS
from .profiles import PROFILES, get_profile
from .records import Prepared, Profile

__all__ = ["xp_assert_close", "xp_assert_equal", "xp_assert_kind", "default_tolerance",
           "check_tolerance", "compare_to_reference", "assert_matches_reference",
           "compare_lse", "Comparison", "Profile", "PROFILES", "get_profile", "LAYOUTS",
           "Prepared", "compare_grads", "assert_grads_match", "GradComparison",
           "TOLERANCE_FACTOR", "EPS", "round_to", "RULES", "check_kernel",
           "assert_kernel_conforms", "KernelCheck", "plain"]
