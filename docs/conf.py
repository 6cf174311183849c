"""Sphinx configuration: builds offline; CI builds with -W (warnings are errors)."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "arrayattn"
author = "arrayattn developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.mathjax", "numpydoc"]
try:   # MathJax bundled into the build, so formulas render offline (the docs extra)
    import importlib
    importlib.import_module("sphinx-mathjax-offline")
    extensions.append("sphinx-mathjax-offline")
except ImportError:
    pass
numpydoc_show_class_members = False
numpydoc_validation_checks = set()
autodoc_typehints = "none"
exclude_patterns = ["_build", "_generated"]
html_theme = "alabaster"
# No network at build time; with sphinx-mathjax-offline MathJax is copied into _static.


def _write_catalogue():
    """docs/_generated/catalogue.rst: one table row per registered variant."""
    import arrayattn

    def cell(text):
        return str(text).replace("|", "/").replace("\n", " ") or "-"

    head = ["name", "family", "exact", "causal", "key_mask", "parameter", "complexity",
            "citation"]
    rows = []
    for rec in arrayattn.variants():
        param = "-" if rec.parameter is None else f"``{rec.parameter}={rec.parameter_value}``"
        rows.append([f"``{rec.name}``", rec.family, "yes" if rec.exact else "no",
                     "yes" if rec.causal else "no", "yes" if rec.key_mask else "no", param,
                     cell(rec.complexity), cell(rec.citation)])
    lines = [".. list-table::", "   :header-rows: 1", ""]
    for row in [head] + rows:
        lines.append("   * - " + row[0])
        lines += [f"     - {c}" for c in row[1:]]
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_generated")
    os.makedirs(out_dir, exist_ok=True)
    text = "\n".join(lines) + "\n"
    path = os.path.join(out_dir, "catalogue.rst")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as fh:
            fh.write(text)


_write_catalogue()
