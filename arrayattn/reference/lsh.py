"""Reference forms: lsh (filled in by the reference-form redesign)."""
__all__: list[str] = []
