"""Reference forms: exact (filled in by the reference-form redesign)."""
__all__: list[str] = []
