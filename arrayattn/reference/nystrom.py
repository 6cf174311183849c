"""Reference forms: nystrom (filled in by the reference-form redesign)."""
__all__: list[str] = []
