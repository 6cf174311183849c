"""pytest, for the doctests collected from ``arrayattn/``: a module whose every example
needs an optional backend is left out when that backend is not installed (the README's
test command runs on a bare venv)."""
import importlib.util

collect_ignore = [] if importlib.util.find_spec("jax") else ["arrayattn/distributed.py"]
