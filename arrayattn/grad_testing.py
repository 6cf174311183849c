"""The gradient referee under its former name: :mod:`arrayattn.testing.grads` (and
``compare_lse`` of :mod:`arrayattn.testing.outputs`)."""
from __future__ import annotations

from .testing.grads import RULES, GradComparison, assert_grads_match, compare_grads, round_to
from .testing.outputs import compare_lse

__all__ = ["compare_grads", "assert_grads_match", "compare_lse", "round_to", "GradComparison",
           "RULES"]
