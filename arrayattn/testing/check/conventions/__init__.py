"""The calling conventions of ``arrayattn check``: one small adapter per convention (layout,
argument names and defaults, alignment rules, what it returns, how the lse and the final
state come back, which options it takes), mapping a case to a call and the result to the
referee's problem."""
from __future__ import annotations

import difflib

from .base import Call, Convention
from .custom import CUSTOM_OPTIONS, Custom
from .fla import FlaDeltaRule, FlaGatedDeltaRule, FlaGla, FlaSimpleGla
from .flash import FlashAttn, FlashAttnKVCache, FlashAttnVarlen
from .flashinfer import (FlashInferBatchDecode, FlashInferBatchPrefill,
                         FlashInferSingleDecode, FlashInferSinglePrefill)
from .softmax import FlexAttention, JaxDotProductAttention, Sdpa
from .triton_tutorial import TritonTutorial
from .vllm import VllmPagedAttention
from .xformers import XFormers

__all__ = ["CONVENTIONS", "get_convention", "Call", "Convention", "Custom", "CUSTOM_OPTIONS"]

#: The named conventions (``--convention``); ``custom`` takes an adapter object.
CONVENTIONS = {c.name: c for c in (Sdpa, FlexAttention, JaxDotProductAttention, FlashAttn,
                                   FlashAttnVarlen, FlashAttnKVCache, FlaGla, FlaSimpleGla,
                                   FlaDeltaRule, FlaGatedDeltaRule,
                                   # the kernels people ship (issue #51)
                                   XFormers, FlashInferSinglePrefill, FlashInferSingleDecode,
                                   FlashInferBatchPrefill, FlashInferBatchDecode,
                                   VllmPagedAttention, TritonTutorial)}


def get_convention(convention, device: str = "cpu") -> Convention:
    """A :class:`Convention` from its name, a Convention, or a custom adapter object."""
    if isinstance(convention, Convention):
        conv = convention
    elif isinstance(convention, str):
        if convention not in CONVENTIONS:
            close = difflib.get_close_matches(convention, list(CONVENTIONS), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown convention {convention!r}{hint} (known: "
                             f"{', '.join(sorted(CONVENTIONS))}, or a custom adapter "
                             "object)")
        conv = CONVENTIONS[convention]()
    else:
        conv = Custom(convention)
    conv.device = device
    return conv
