"""What a report row's variant is to softmax attention: exact, an approximation of it, or an
architecture of its own (the table ranks and the plot draws each kind apart)."""
from __future__ import annotations

__all__ = ["OWN_ARCHITECTURE", "kind_of"]

#: Variants that are architectures of their own, trained as such: their distance from
#: softmax attention is not an approximation error (Linformer with random E/F, Luna,
#: Poolingformer, and the gated/delta-rule recurrences).
OWN_ARCHITECTURE = {"linformer", "luna", "poolingformer"}


def kind_of(rec) -> str:
    """``"exact"``, ``"approximates softmax"`` or ``"own architecture"``."""
    if rec.exact:
        return "exact"
    if rec.name in OWN_ARCHITECTURE or rec.family == "gated":
        return "own architecture"
    return "approximates softmax"
