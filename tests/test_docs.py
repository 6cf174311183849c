"""The documentation: its examples run, it builds with warnings as errors, and every public
function is documented (numpydoc docstring with shapes and an example, listed in api.rst).

These tests guard every later addition: a public function added to ``arrayattn.__all__``
without an example or an api.rst entry fails here.
"""
from __future__ import annotations

import doctest
import glob
import importlib.util
import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

import arrayattn
import arrayattn.testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
RST = sorted(p for p in glob.glob(os.path.join(DOCS, "**", "*.rst"), recursive=True)
             if "_generated" not in p and "_build" not in p)


def python_blocks(path):
    """The ``.. code-block:: python`` bodies of an rst file, dedented, with line numbers."""
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)\.\. code-block:: python\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        start = i + 1
        i += 1
        while i < len(lines) and re.match(r"^\s+:\w[\w-]*:", lines[i]):  # options
            i += 1
        body = []
        while i < len(lines):
            line = lines[i]
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break
            body.append(line)
            i += 1
        width = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
        blocks.append((start, "\n".join(b[width:] for b in body)))
    return blocks


def rel(path):
    return os.path.relpath(path, ROOT)


def markdown_python_blocks(path):
    """The ```python fenced blocks of a Markdown file, with line numbers."""
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body)))
        i += 1
    return blocks


def page_examples(path):
    if path.endswith(".md"):
        return markdown_python_blocks(path), False
    return python_blocks(path), ">>>" in open(path, encoding="utf-8").read()


PAGES = [p for p in RST + [os.path.join(ROOT, "README.md")] if any(page_examples(p))]


def test_pages_have_examples():
    names = {rel(p) for p in PAGES}
    assert {"docs/validating.rst", "docs/report.rst", "README.md"} <= names


@pytest.mark.parametrize("path", PAGES, ids=rel)
def test_page_examples_run(path, tmp_path, monkeypatch):
    """Every python code block of a page runs (the blocks of one page share a namespace,
    as a reader runs them in order); ``>>>`` examples pass as doctests."""
    blocks, has_doctest = page_examples(path)
    monkeypatch.chdir(tmp_path)  # examples may write files (np.savez ...)
    namespace = {"__name__": "__docs__"}
    for line, code in blocks:
        if any(f"import {lib}" in code and importlib.util.find_spec(lib) is None
               for lib in ("torch", "cupy", "jax")):
            continue            # an optional backend this machine lacks
        try:
            exec(compile(code, f"{rel(path)}:{line}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"code block at {rel(path)}:{line} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
    if has_doctest:
        res = doctest.testfile(path, module_relative=False, verbose=False, report=True,
                               optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
        assert res.failed == 0, f"{res.failed} doctest(s) failed in {rel(path)}"


def test_docs_build_with_warnings_as_errors(tmp_path):
    for mod in ("sphinx", "numpydoc"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (pip install '.[docs]')")
    res = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", DOCS,
         str(tmp_path / "html")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    page = (tmp_path / "html" / "catalogue.html").read_text()
    for rec in arrayattn.variants():  # the generated catalogue lists every variant
        assert rec.name in page
    if importlib.util.find_spec("sphinx-mathjax-offline") is not None:
        # formulas render offline: MathJax is bundled, no page loads it from a server
        math_page = (tmp_path / "html" / "variants" / "exact.html").read_text()
        assert "_static/mathjax/tex-chtml.js" in math_page
        assert not re.search(r"src=\"https?://[^\"]*mathjax", math_page, re.I)
        assert (tmp_path / "html" / "_static" / "mathjax" / "tex-chtml.js").exists()


def public_objects():
    objs = [(f"arrayattn.{name}", getattr(arrayattn, name)) for name in arrayattn.__all__]
    objs += [(f"arrayattn.testing.{name}", getattr(arrayattn.testing, name))
             for name in ("assert_matches_reference", "compare_to_reference")]
    for module in map(importlib.import_module, ("arrayattn.distributed", "arrayattn.data")):
        objs += [(f"{module.__name__}.{name}", getattr(module, name))
                 for name in module.__all__]
    return [(name, obj) for name, obj in objs if callable(obj)]


@pytest.mark.parametrize("name, obj", public_objects(), ids=[n for n, _ in public_objects()])
def test_public_function_documented(name, obj):
    """Functions: a numpydoc docstring with a runnable Examples section, and the shapes
    when they take ``q``.  Classes: a docstring.  Both: an entry in docs/api.rst."""
    numpydoc = pytest.importorskip("numpydoc.docscrape")
    doc_text = inspect.getdoc(obj)
    assert doc_text, f"{name} has no docstring"
    if not inspect.isclass(obj):
        doc = numpydoc.FunctionDoc(obj)
        assert "".join(doc["Examples"]).strip(), (
            f"{name}: the docstring has no Examples section")
        assert ">>>" in "\n".join(doc["Examples"]), (
            f"{name}: Examples hold no runnable example")
        params = inspect.signature(obj).parameters
        if "q" in params:
            documented = {p.name.split(":")[0].strip() for p in doc["Parameters"]}
            documented = {x.strip() for p in documented for x in p.split(",")}
            assert "q" in documented, f"{name}: q is not in the Parameters section"
            assert "shape" in doc_text, f"{name}: the docstring does not give the shapes"
    api = open(os.path.join(DOCS, "api.rst"), encoding="utf-8").read()
    assert re.search(rf"^\.\. auto(function|class):: {re.escape(name)}\s*$", api, re.M), (
        f"{name} is not in docs/api.rst (add '.. auto{'class' if inspect.isclass(obj) else 'function'}:: {name}')")


def test_every_rst_page_is_in_a_toctree():
    index = open(os.path.join(DOCS, "index.rst"), encoding="utf-8").read()
    for path in RST:
        page = os.path.splitext(os.path.relpath(path, DOCS))[0].replace(os.sep, "/")
        if page != "index":
            assert re.search(rf"^\s+{re.escape(page)}\s*$", index, re.M), (
                f"docs/{page}.rst is not in a toctree of docs/index.rst")
