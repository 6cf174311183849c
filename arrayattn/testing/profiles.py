"""The table of named port profiles (``profile=`` of the referees, ``--profile`` of
``arrayattn validate``)."""
from __future__ import annotations

from .ports_approximate import (FAST_TRANSFORMERS, FLA, HF_NYSTROMFORMER, LUCIDRAINS_NYSTROM,
                                PERFORMER_PYTORCH)
from .ports_softmax import FLASH_ATTN, FLEX_ATTENTION, SDPA
from .records import Profile

__all__ = ["PROFILES", "get_profile"]

#: The named port profiles of :func:`compare_to_reference` (``profile=``).
PROFILES = {p.name: p for p in (SDPA, FLASH_ATTN, FLEX_ATTENTION, PERFORMER_PYTORCH,
                                LUCIDRAINS_NYSTROM, HF_NYSTROMFORMER, FAST_TRANSFORMERS, FLA)}


def get_profile(profile) -> Profile:
    """A :class:`Profile` from its name (or the profile itself).

    Examples
    --------
    >>> from arrayattn.testing import get_profile
    >>> get_profile("flash_attn").layout
    'bnhd'
    """
    if isinstance(profile, Profile):
        return profile
    try:
        return PROFILES[profile]
    except (KeyError, TypeError):
        raise ValueError(f"profile must be one of {sorted(PROFILES)}; got {profile!r}") from None
