"""Sphinx configuration: builds offline; CI builds with -W (warnings are errors)."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "arrayattn"
author = "arrayattn developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.mathjax", "numpydoc"]
numpydoc_show_class_members = False
numpydoc_validation_checks = set()
autodoc_typehints = "none"
exclude_patterns = ["_build"]
html_theme = "alabaster"
# No network: mathjax is referenced, never fetched at build time.
