"""The checker's example database: a finding's :class:`~.cases.Case` stored as JSON under
Hypothesis' example database (``.hypothesis/examples`` by default), keyed by a test and a
convention, so that the next run tries it first (the pytest plugin's replay)."""
from __future__ import annotations

import json
from dataclasses import asdict, fields

from .cases import Case

__all__ = ["case_to_json", "case_from_json", "database_key", "stored_cases", "store_case",
           "forget_cases"]


def _tuples(value):
    """JSON lists back to tuples (option values such as a window ``(2, 0)``)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def case_to_json(case: Case) -> str:
    """The case as a JSON object (its fields; ``options`` as ``[[name, value], ...]``).

    >>> text = case_to_json(Case(n=3, options=(("causal", True),)))
    >>> json.loads(text)["n"], json.loads(text)["options"]
    (3, [['causal', True]])
    """
    return json.dumps(asdict(case), sort_keys=False)


def case_from_json(text) -> Case:
    """The :class:`Case` of :func:`case_to_json` (unknown fields: ValueError).

    >>> c = Case(n=3, options=(("window", (2, 0)),))
    >>> case_from_json(case_to_json(c)) == c
    True
    """
    data = json.loads(text)
    names = {f.name for f in fields(Case)}
    if not isinstance(data, dict) or set(data) - names:
        raise ValueError(f"not a stored case: {text!r}")
    data["options"] = tuple((str(k), _tuples(v)) for k, v in data.get("options", ()))
    return Case(**data)


def database_key(test_id: str, convention: str) -> bytes:
    """The database key of a test's cases under a convention."""
    return f"arrayattn.check:{test_id}:{convention}".encode()


def stored_cases(db, key: bytes, conv) -> list:
    """The cases stored under ``key`` that still make sense for ``conv`` (their options
    in its option space); an unreadable entry is dropped from the database."""
    out = []
    for raw in sorted(db.fetch(key)):
        try:
            case = case_from_json(raw.decode())
        except (ValueError, TypeError, UnicodeDecodeError):
            db.delete(key, raw)
            continue
        if all(k in conv.space and v in conv.space[k] for k, v in case.active().items()):
            out.append(case)
    return sorted(out, key=Case.size)


def forget_cases(db, key: bytes) -> None:
    """Remove every case stored under ``key``."""
    for raw in list(db.fetch(key)):
        db.delete(key, raw)


def store_case(db, key: bytes, case: Case) -> None:
    """Keep ``case`` as the one stored under ``key`` (the smallest finding of this run)."""
    forget_cases(db, key)
    db.save(key, case_to_json(case).encode())
