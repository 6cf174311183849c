"""Lines of code of arrayattn: per reference form, per engine module, per package.

Counts the lines of each function body that are code -- no docstrings, comments or blank
lines -- so the readability promise of the reference layer ("a body of ~25 lines or
fewer per variant") is measured, not claimed.

    python benchmarks/lines.py [--root arrayattn] [--markdown]
"""
from __future__ import annotations

import argparse
import ast
import io
import pathlib
import tokenize


def code_lines(source: str) -> set[int]:
    """Line numbers that hold code tokens (not comments, docstrings or blank lines)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(
                    getattr(body[0], "value", None), ast.Constant) and isinstance(
                    body[0].value.value, str):
                docstrings |= set(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
            tokenize.DEDENT, tokenize.ENCODING, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines |= set(range(tok.start[0], tok.end[0] + 1))
    return lines - docstrings


def functions(path: pathlib.Path):
    """``(name, body code lines)`` of each top-level function of ``path``."""
    source = path.read_text()
    lines = code_lines(source)
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            body = set(range(node.body[0].lineno, node.end_lineno + 1))
            yield node.name, len(lines & body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(pathlib.Path(__file__).parent.parent / "arrayattn"))
    args = ap.parse_args(argv)
    root = pathlib.Path(args.root)
    print("| module | code lines |\n|---|---:|")
    total = 0
    for path in sorted(root.rglob("*.py")):
        n = len(code_lines(path.read_text()))
        total += n
        print(f"| {path.relative_to(root)} | {n} |")
    print(f"| **total** | {total} |\n")
    ref = root / "reference"
    if ref.is_dir():
        print("| reference form | body lines |\n|---|---:|")
        for path in sorted(ref.glob("*.py")):
            for name, n in functions(path):
                if not name.startswith("_"):
                    print(f"| {path.stem}.{name} | {n} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
