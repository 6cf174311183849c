"""``arrayattn report``: the table, the JSON, the plot, the backends, the errors."""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import arrayattn
from arrayattn import Variant, registry, softmax_attention
from arrayattn.cli import main
from arrayattn.report.run import (BASELINE, CASES, Workload, make_inputs, reference,
                                  run_report, run_sweeps, sweep_values)
from arrayattn.report.kinds import kind_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--n", "48", "--d", "16", "--heads", "2", "--repeats", "1"]


def window_attention(q, k, v, *, window=8, **kw):
    """A toy approximation for the sweeps: exact softmax inside a band |i - j| <= window."""
    n, s = q.shape[-2], k.shape[-2]
    band = np.abs(np.arange(n)[:, None] - np.arange(s)[None, :]) <= window
    return softmax_attention(q, k, v, mask=band, **kw)


def broken_attention(q, k, v, **kw):
    raise RuntimeError("this variant is broken on purpose")


@pytest.fixture
def toy_variants(monkeypatch):
    """Register two throw-away variants for the duration of a test only."""
    common = dict(family="test", causal=False, key_mask=False, complexity="",
                  citation="", exact=False)
    for rec in (Variant(name="toy_window", fn=window_attention, defaults={"window": 8},
                        parameter="window", **common),
                Variant(name="toy_broken", fn=broken_attention, **common)):
        monkeypatch.setitem(registry._REGISTRY, rec.name, rec)


def table_rows(text):
    """The variants' rows of the printed table (the baseline rows and the conclusions
    after the blank line aside)."""
    table = text.strip().split("\n\n")[0]
    return [ln.split() for ln in table.splitlines()[2:] if not ln.startswith("baseline")]


def variant_rows(rows):
    return [r for r in rows if r.kind != "baseline"]


class TestReportNumbers:
    def test_columns_against_independent_computation(self):
        w = Workload(n=40, d=8, heads=3, batch=2, dtype="float64", repeats=2)
        rows = {(r.variant, r.case): r for r in variant_rows(run_report(w, ["softmax"]))}
        assert set(rows) == {("softmax", c) for c in CASES}
        for case in CASES:
            r = rows[("softmax", case)]
            q, k, v = make_inputs(w, case)
            # exact in float64: errors at rounding level, rows sum to 1
            assert r.rel_error < 1e-14 and r.matrix_error < 1e-14 and r.row_sum_dev < 1e-14
            assert len(r.times_ms) == 2 and r.median_ms > 0 and r.peak_mib > 0
            # rel. error is ||O - O*|| / ||O*|| with O* the float64 reference
            out = np.asarray(softmax_attention(q, k, v))
            assert abs(np.linalg.norm(out - reference(q, k, v))
                       / np.linalg.norm(reference(q, k, v)) - r.rel_error) < 1e-15

    def test_sharp_case_has_bert_norms(self):
        q, k, v = make_inputs(Workload(n=16, d=32), "sharp")
        np.testing.assert_allclose(np.linalg.norm(q, axis=-1), 8.0)
        np.testing.assert_allclose(np.linalg.norm(k, axis=-1), 8.0)
        def top_weight(q, k):
            logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
            w = np.exp(logits - logits.max(-1, keepdims=True))
            return np.median((w / w.sum(-1, keepdims=True)).max(-1))
        w = Workload(n=1024, d=64, heads=1)
        assert top_weight(*make_inputs(w, "sharp")[:2]) > 0.3      # peaked
        assert top_weight(*make_inputs(w, "gaussian")[:2]) < 0.05  # diffuse
        q, k, v = make_inputs(Workload(n=16, d=32), "gaussian")
        assert abs(q.std() - 1) < 0.1

    def test_approximation_errors_and_matrix_bound(self, toy_variants):
        w = Workload(n=64, d=16, heads=2, repeats=1)
        rows = {(r.variant, r.case): r for r in run_report(w, ["softmax", "toy_window"])}
        for case in CASES:
            exact, approx = rows[("softmax", case)], rows[("toy_window", case)]
            assert exact.rel_error < 1e-5 and approx.rel_error > 1e-2
            # |o_i - o*_i| <= ||a_i - a*_i||_1 max|v|: the matrix error is the larger
            assert approx.matrix_error > 1e-2 and approx.row_sum_dev < 1e-5
            assert approx.parameter == "window=8"

    def test_not_linear_in_v_has_no_matrix(self, monkeypatch):
        """A record with ``linear_in_v=False`` (weights depend on v) gets no implied
        matrix and no row sums, but its output error."""
        import dataclasses
        kw = dict(name="toy_nonlinear", fn=window_attention, family="test", causal=False,
                  key_mask=False, complexity="", citation="", exact=False)
        if "linear_in_v" in {f.name for f in dataclasses.fields(Variant)}:
            rec = Variant(linear_in_v=False, **kw)
        else:  # the field comes with the LSH/Luna branch; the report reads it by getattr
            class NotLinear(Variant):
                linear_in_v = False
            rec = NotLinear(**kw)
        monkeypatch.setitem(registry._REGISTRY, rec.name, rec)
        rows = variant_rows(run_report(Workload(n=32, d=8, heads=1, repeats=1),
                                       ["toy_nonlinear"]))
        assert all(r.matrix_error is None and r.row_sum_dev is None and r.rel_error > 0
                   for r in rows)

    def test_broken_variant_does_not_stop_the_report(self, toy_variants, capsys):
        code = main(["report", *SMALL, "--variants", "toy_broken,softmax", "--quiet"])
        out = capsys.readouterr().out
        assert code == 0
        assert "error: RuntimeError: this variant is broken on purpose" in out
        assert sum(r[0] == "softmax" for r in table_rows(out)) == len(CASES)

    def test_sweeps(self, toy_variants):
        w = Workload(n=64, d=16, heads=1, repeats=1)
        rec = arrayattn.get_variant("toy_window")
        assert sweep_values(rec, 64) == [2, 4, 8, 16]
        assert sweep_values(arrayattn.get_variant("softmax_blockwise"), 64) == []  # exact
        # a parameter whose default is in the function's signature, not in the record
        sig_only = Variant(name="sig_only", fn=window_attention, family="test",
                           causal=False, key_mask=False, complexity="", citation="",
                           exact=False, parameter="window")
        assert sweep_values(sig_only, 64) == [2, 4, 8, 16]
        sw = run_sweeps(w, ["softmax", "toy_window"])
        errs = [p["rel_error"] for p in sw["errors"] if p["case"] == "sharp"]
        assert len(errs) == 4 and errs == sorted(errs, reverse=True)  # wider band, smaller error
        assert {p["n"] for p in sw["scaling"]} == {16, 32, 64, 128}


class TestReportCommand:
    def test_table_and_json_without_matplotlib_options(self, tmp_path, capsys, toy_variants):
        """The table and the JSON need nothing optional (a bare ``pip install .``)."""
        js = tmp_path / "r.json"
        code = main(["report", *SMALL, "--json", str(js), "--quiet"])
        cap = capsys.readouterr()
        assert code == 0, cap.err
        names = [r.name for r in arrayattn.variants()]
        rows = table_rows(cap.out)
        assert sorted(r[0] for r in rows) == sorted(names * len(CASES))   # ranked per kind
        assert [r[1] for r in rows] == [c for c in CASES for _ in names]   # case by case
        assert len(json.loads(js.read_text())["rows"]) == (len(names) + 1) * len(CASES)

    def test_table_json_plot(self, tmp_path, capsys, toy_variants):
        pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
        js, png = tmp_path / "r.json", tmp_path / "r.png"
        code = main(["report", *SMALL, "--json", str(js), "--plot", str(png)])
        cap = capsys.readouterr()
        assert code == 0
        names = [r.name for r in arrayattn.variants()]
        rows = table_rows(cap.out)
        assert sorted(r[0] for r in rows) == sorted(names * len(CASES))   # ranked per kind
        assert cap.out.splitlines()[0].split()[:4] == ["variant", "case", "parameter", "rel."]
        # the progress bar goes to stderr and ends complete
        assert re.search(r"\[#+\] (\d+)/\1 ", cap.err)
        data = json.loads(js.read_text())
        assert data["workload"]["n"] == 48 and data["machine"]["numpy"] == np.__version__
        assert len(data["rows"]) == (len(names) + 1) * len(CASES)
        swept = {p["variant"] for p in data["sweeps"]["errors"]}
        assert "toy_window" in swept
        assert not any(arrayattn.get_variant(name).exact for name in swept)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20000

    @pytest.mark.parametrize("backend", ["array_api_strict", "torch", "jax"])
    def test_backends(self, backend, capsys):
        pytest.importorskip(backend)
        code = main(["report", *SMALL, "--backend", backend, "--variants", "softmax",
                     "--quiet"])
        cap = capsys.readouterr()
        assert code == 0, cap.err
        assert f"backend={backend}" in cap.err
        for row in table_rows(cap.out):
            assert float(row[2]) < 1e-5  # rel. error of exact softmax in float32

    @pytest.mark.parametrize("argv, message", [
        (["--backend", "numpy", "--dtype", "bfloat16"], "numpy has no bfloat16"),
        (["--variants", "softmax,nope"], "no variant named 'nope'; registered: softmax"),
        (["--n", "0"], "--n must be a positive integer"),
    ])
    def test_usage_errors(self, argv, message, capsys):
        assert main(["report", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("arrayattn report: error: ") and message in err

    def test_missing_backend_is_a_clear_error(self, capsys, monkeypatch):
        """A backend that is not installed: exit 2 naming the package to install."""
        import builtins
        real_import = builtins.__import__

        def fake_import(name, *args, **kwargs):
            if name.split(".")[0] == "cupy":
                raise ImportError("No module named 'cupy'")
            return real_import(name, *args, **kwargs)
        monkeypatch.setattr(builtins, "__import__", fake_import)
        monkeypatch.delitem(sys.modules, "cupy", raising=False)
        assert main(["report", "--backend", "cupy"]) == 2
        err = capsys.readouterr().err
        assert "backend 'cupy' needs the 'cupy' package, which is not installed" in err

    def test_defaults_are_documented(self):
        """The README and docs/report.rst state the default workload the code runs."""
        w = Workload()
        text = open(os.path.join(ROOT, "README.md")).read()
        expect = (f"batch {w.batch}, {w.heads} heads, n = s = {w.n}, d = dv = {w.d}, "
                  f"{w.dtype}, seed {w.seed}")
        assert expect in " ".join(text.split())
        docs = open(os.path.join(ROOT, "docs", "report.rst")).read()
        assert expect in " ".join(docs.split())

    def test_python_m_arrayattn_report(self):
        res = subprocess.run([sys.executable, "-m", "arrayattn", "report", *SMALL],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert len(table_rows(res.stdout)) == len(arrayattn.variants()) * len(CASES)


def test_baseline_row_and_kinds():
    """Every case has the mean-of-v baseline; each variant says whether it approximates
    softmax attention or is an architecture of its own."""
    rows = run_report(Workload(n=64, d=8, heads=1, repeats=1),
                      ["softmax", "performer_positive", "linformer"])
    base = [r for r in rows if r.kind == "baseline"]
    assert [r.case for r in base] == list(CASES)
    assert all(0.0 < r.rel_error < 2.0 and r.row_sum_dev == 0.0 for r in base)
    kinds = {r.variant: r.kind for r in rows if r.kind != "baseline"}
    assert kinds == {"softmax": "exact", "performer_positive": "approximates softmax",
                     "linformer": "own architecture"}
    assert all(r.min_ms <= r.median_ms for r in rows if r.kind != "baseline")


def test_real_heads_data():
    """The shipped real heads: shapes, finite, trained-head norms, provenance, and the
    baseline (mean of v) about 0.8 from exact attention, as on real transformers."""
    from arrayattn.data import real_heads, real_heads_info
    q, k, v = real_heads()
    assert q.shape == k.shape == v.shape == (36, 256, 32) and q.dtype == np.float64
    assert all(np.isfinite(x).all() for x in (q, k, v))
    assert 5.0 < np.linalg.norm(q, axis=-1).mean() < 9.0
    assert 5.0 < np.linalg.norm(k, axis=-1).mean() < 9.0
    info = real_heads_info()
    assert info["model_licence"] == "Apache-2.0" and info["layers"] == [0, 2, 5]
    assert "public domain" in info["text"] and info["tokens"] == 256
    ref = reference(q, k, v)
    base = np.broadcast_to(v.mean(axis=-2, keepdims=True), ref.shape)
    assert 0.7 < np.linalg.norm(base - ref) / np.linalg.norm(ref) < 0.9
    q[0, 0, 0] = 1e9                       # a copy: the cached data is not touched
    assert real_heads()[0][0, 0, 0] != 1e9


def test_real_case_in_the_report():
    """``real`` is a default case, with its own shape whatever the workload says; exact
    attention scores rounding error there, the baseline about 0.8."""
    assert "real" in CASES
    q, k, v = make_inputs(Workload(n=40, d=8, heads=3), "real")
    assert q.shape == (1, 36, 256, 32)
    rows = run_report(Workload(n=40, d=8, heads=2, repeats=1), ["softmax"])
    real = {r.variant: r for r in rows if r.case == "real"}
    assert real["softmax"].rel_error < 1e-6
    assert 0.7 < real[BASELINE].rel_error < 0.9


def test_plot_panels_per_family_and_parameter():
    """One error panel per (family, parameter) of the approximations of softmax: window
    and stride never share an axis, exact variants and own architectures have none; at
    most MAX_LINES curves a panel; time panels one family each."""
    from arrayattn.report.plot import MAX_LINES, error_panels, time_panels
    names = [r.name for r in arrayattn.variants()]
    panels = error_panels(names)
    titles = [t for t, _, _ in panels]
    assert "sparse: window" in titles and "sparse: stride" in titles
    assert len(titles) == len(set(titles))
    assert "block_size" not in [p for _, p, _ in panels]   # blockwise is not approximate
    members = [n for _, _, group in panels for n in group]
    assert all(kind_of(arrayattn.get_variant(n)) == "approximates softmax" for n in members)
    assert all(len(group) <= MAX_LINES for _, _, group in panels)
    for _, group in time_panels(names):
        assert len(group) <= MAX_LINES
        assert len({arrayattn.get_variant(n).family for n in group}) == 1


def test_verdicts_rank_and_conclude():
    """Verdicts from the case's own rows, rows ranked within each kind, a closing line per
    case naming the most accurate approximation and the fastest that beats the baseline."""
    from arrayattn.report.run import Row
    from arrayattn.report.table import conclusions, format_table, ranked, verdict
    rows = [Row("slow_good", "c", "kernel", rel_error=0.1, min_ms=9.0, kind="approximates softmax"),
            Row("softmax", "c", "exact", rel_error=3e-7, min_ms=1.0, kind="exact"),
            Row("bad", "c", "kernel", rel_error=0.9, min_ms=0.5, kind="approximates softmax"),
            Row("fast_ok", "c", "kernel", rel_error=0.4, min_ms=2.0, kind="approximates softmax"),
            Row("covers", "c", "sparse", rel_error=1e-6, min_ms=3.0, kind="approximates softmax"),
            Row("gla", "c", "gated", rel_error=50.0, min_ms=1.0, kind="own architecture"),
            Row(BASELINE, "c", "", rel_error=0.8, kind="baseline")]
    v = {r.variant: verdict(r, rows) for r in rows}
    assert v["softmax"] == "exact" and v["gla"] == "own architecture"
    assert v["slow_good"] == "beats the mean of v by 8.0x"
    assert v["bad"] == "no better than the mean of v"
    assert v["covers"] == "exact here (its pattern covers every pair at this n)"
    assert [r.variant for r in ranked(rows)] == [BASELINE, "softmax", "covers", "slow_good",
                                                 "fast_ok", "bad", "gla"]
    (line,) = conclusions(rows)
    assert "most accurate approximation of softmax: covers" in line
    assert "fastest that beats the mean of v: fast_ok" in line   # 'bad' is faster, not useful
    table = format_table(rows)
    assert "verdict" in table.splitlines()[0] and table.rstrip().endswith(line.rstrip())


class _Counting:
    """A prepared call that counts its calls."""

    def __init__(self, call):
        self.call, self.calls = call, 0

    def __call__(self, q, k, v):
        self.calls += 1
        return self.call(q, k, v)


def _column_blocks(be, call, hq, hk, v_shape, dtype):
    """The implied matrix the way the report read it before issue #39: one call per block
    of ``dv`` of the identity's columns (the block in every head slot), slot 0 read."""
    from arrayattn.report.calls import on_host
    s, dv, n = v_shape[-2], v_shape[-1], hq.shape[-2]
    slots = int(np.prod(v_shape[:-2]))
    q0, k0 = (be.asarray(np.broadcast_to(x[:1, :1], x.shape), dtype) for x in (hq, hk))
    cols = []
    for j0 in range(0, s, dv):
        block = np.zeros((slots, s, dv))
        block[:, :, :min(dv, s - j0)] = np.eye(s)[:, j0:j0 + dv]
        out = on_host(call(q0, k0, be.asarray(np.reshape(block, v_shape), dtype)))
        cols.append(np.reshape(out, (slots, n, dv))[0][:, :min(dv, s - j0)])
    return np.concatenate(cols, axis=-1)


#: (q shape, v shape): 3 heads cannot carry 7 blocks of 6 columns twice -> with
#: wide=True the program whose v carries the whole identity, else block by block
#: ("blocks"); 12 heads carry 4 blocks of 6 three times -> the case's own program.
MATRIX_SHAPES = {"wide": ((1, 3, 40, 8), (1, 3, 40, 6)),
                 "blocks": ((1, 3, 40, 8), (1, 3, 40, 6)),
                 "slots": ((1, 12, 24, 8), (1, 12, 24, 6))}


@pytest.mark.parametrize("path", list(MATRIX_SHAPES))
@pytest.mark.parametrize("name", ["softmax", "local", "retention", "gla", "lsh",
                                  "linear_taylor", "nystrom_svd"])
def test_compiled_implied_matrix_in_one_call(name, path):
    """On JAX the implied matrix of the first head comes from one call of the compiled
    variant per case (issue #39 point 5) where the case's own program carries every
    block of the identity's columns twice (the report's real case), or with wide=True
    (a program whose v is I_s): the identity's columns all in that call.  Otherwise (the
    report's default for 2 heads) the column blocks, slots x dv columns a call after a
    first call that compares the slots.  Every form equals, to float32 rounding, the
    column-block form (one call per block of dv columns), and NumPy's float64 matrix to
    1e-4.  The exception, stated: read through the case's own program, a variant whose
    heads differ (retention's per-head decays, gla's gates drawn per head) takes one call
    per block."""
    pytest.importorskip("jax")
    from arrayattn.report.backends import get_array_backend
    from arrayattn.report.calls import Compiled, implied_matrix, wide_v_shape
    rec = arrayattn.get_variant(name)
    q_shape, v_shape = MATRIX_SHAPES[path]
    assert (wide_v_shape(v_shape) is None) == (path == "slots")
    rng = np.random.default_rng(0)
    hq, hk = (rng.standard_normal(q_shape) for _ in range(2))
    opts = {"num_landmarks": 8} if name == "nystrom_svd" else {}
    want, _ = implied_matrix(get_array_backend("numpy", "float64"),
                             lambda q, k, v: rec(q, k, v, **opts), hq, hk, v_shape,
                             "float64")
    be = get_array_backend("jax", "float32")
    prepared = Compiled(be)(rec) if not opts else be.compile(
        lambda q, k, v: rec(q, k, v, **opts))
    call = _Counting(prepared)
    wide = path == "wide"
    got, alike = implied_matrix(be, call, hq, hk, v_shape, "float32", wide=wide)
    s, dv = v_shape[-2], v_shape[-1]
    blocks = -(-s // dv)
    slots = int(np.prod(v_shape[:-2]))
    differ = name in ("retention", "gla")
    if wide:
        assert alike is None and call.calls == 1
    elif path == "slots":
        assert alike == (not differ)
        assert call.calls == (blocks if differ else 1)
    else:
        assert alike == (not differ)
        assert call.calls == (blocks if differ else 1 + -(-(blocks - 1) // slots))
    assert got.shape == want.shape == (1, 1, s, s)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    by_block = _column_blocks(be, prepared, hq, hk, v_shape, "float32")
    eps = np.finfo(np.float32).eps
    assert np.abs(got[0, 0] - by_block).max() <= 64 * eps * np.abs(by_block).max()
    # told what the heads are (as a later case is): the same matrix, no first call
    call.calls = 0
    again, _ = implied_matrix(be, call, hq, hk, v_shape, "float32", alike, wide=wide)
    np.testing.assert_array_equal(again, got)
    assert call.calls == (1 if wide else blocks if differ else -(-blocks // slots))


def test_timed_makes_no_warm_up_call_where_the_program_ran_already():
    """On JAX a program that has run already -- in an earlier case of the same shapes,
    the sharp case after the gaussian one -- is warm, so ``timed`` makes only the
    ``repeats`` timed calls and returns the first one's output (the same program on the
    same inputs: the warm-up's numbers; issue #39 point 5); a program compiled ahead but
    not run yet gets its warm-up call."""
    pytest.importorskip("jax")
    from arrayattn.report.backends import get_array_backend
    from arrayattn.report.calls import Compiled, timed
    be = get_array_backend("jax", "float32")
    rng = np.random.default_rng(0)
    args = [be.asarray(rng.standard_normal((1, 2, 32, 8)), "float32") for _ in range(3)]
    other = [be.asarray(rng.standard_normal((1, 2, 32, 8)), "float32") for _ in range(3)]
    compiled = Compiled(be)
    compiled.ahead([arrayattn.get_variant("gla")], [args])
    call = compiled(arrayattn.get_variant("gla"))
    assert not call.has_run(*args)
    counting = _Counting(call)
    counting.has_run = call.has_run
    first, times, peak = timed(be, counting, *args, 3)        # the gaussian case
    assert counting.calls == 4 and len(times) == 3 and peak is None
    assert call.has_run(*other)                                # same shapes: warm
    counting.calls = 0
    out, times, _ = timed(be, counting, *other, 3)             # the sharp case
    assert counting.calls == 3 and len(times) == 3
    np.testing.assert_array_equal(np.asarray(out), np.asarray(call(*other)))
    again, _, _ = timed(be, counting, *args, 3)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(first))


def _broken_and_two_shapes(be):
    """A variant that cannot trace, and inputs of two shapes (the report's compile tests)."""
    def broken(q, k, v):
        raise ValueError("cannot trace")

    rng = np.random.default_rng(0)
    inputs = [[be.asarray(rng.standard_normal(sh), "float32") for _ in range(3)]
              for sh in ((1, 2, 32, 8), (1, 3, 16, 4))]
    return Variant(name="broken", fn=broken, family="test", exact=False, causal=False,
                   key_mask=False, complexity="-", citation="-"), inputs


@contextlib.contextmanager
def _backend_compiles(jax):
    """The list of XLA compiles made inside the block."""
    compiles = []

    def listen(event, secs, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_compiled_ahead_once_per_shape():
    """On JAX the report compiles every variant for each input shape before the timing
    (two at a time): afterwards the calls of every case find their program compiled, one
    program per shape, and a variant that fails to trace is left to fail in its own
    row."""
    jax = pytest.importorskip("jax")
    from arrayattn.report.backends import get_array_backend
    from arrayattn.report.calls import Compiled

    be = get_array_backend("jax", "float32")
    compiled = Compiled(be)
    good = [arrayattn.get_variant(n) for n in ("softmax", "retention", "local")]
    bad, inputs = _broken_and_two_shapes(be)
    recs = [*good, bad]
    with _backend_compiles(jax) as compiles:
        compiled.ahead(recs, inputs)
        assert len(compiles) == len(good) * len(inputs)
        for rec in good:
            for args in inputs:
                jax.block_until_ready(compiled(rec)(*args))
        assert len(compiles) == len(good) * len(inputs)      # the calls compiled nothing
    with pytest.raises(ValueError, match="cannot trace"):
        compiled(recs[-1])(*inputs[0])


def test_calls_wait_for_the_programs_compiling_in_the_background():
    """``Compiled.start`` compiles in the background, the first shape's programs first;
    a call of a program still compiling waits for it instead of compiling it again, a
    variant that failed there raises its error in the call, and ``wait`` returns once
    every program is compiled."""
    jax = pytest.importorskip("jax")
    from arrayattn.report.backends import get_array_backend
    from arrayattn.report.calls import Compiled

    be = get_array_backend("jax", "float32")
    compiled = Compiled(be)

    bad, inputs = _broken_and_two_shapes(be)
    recs = [*(arrayattn.get_variant(n) for n in ("retention", "local", "softmax")), bad]
    wants = [[np.asarray(jax.jit(lambda q, k, v: rec(q, k, v))(*args)) for rec in recs[:-1]]
             for args in inputs]
    with _backend_compiles(jax) as compiles:
        compiled.start(recs, inputs)
        for args, want_args in zip(inputs, wants):   # at once: most are still compiling
            for rec, want in zip(recs, want_args):
                got = np.asarray(compiled(rec)(*args))
                assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), rec.name
        with pytest.raises(ValueError, match="cannot trace"):
            compiled(recs[-1])(*inputs[0])
        compiled.wait()
        assert len(compiles) == 3 * len(inputs)       # once each, none twice
        assert all(len(compiled(rec).programs) == 2 for rec in recs[:-1])


def test_report_programs_compile_with_the_cpu_options():
    """On a CPU the report compiles each program once per input shape with
    ``CPU_COMPILER_OPTIONS`` (not through ``jax.jit``'s cache, which compiles with XLA's
    defaults), and those programs give ``jax.jit``'s outputs."""
    jax = pytest.importorskip("jax")
    from arrayattn.report.backends import get_array_backend
    from arrayattn.report.calls import CPU_COMPILER_OPTIONS, Compiled, Executables

    be = get_array_backend("jax", "float32")
    if be.device != "cpu":
        pytest.skip("the options are for XLA's CPU backend")
    compiled = Compiled(be)
    assert compiled.options == CPU_COMPILER_OPTIONS
    rng = np.random.default_rng(1)
    q, k, v = (jax.numpy.asarray(rng.standard_normal((1, 2, 48, 16)), jax.numpy.float32)
               for _ in range(3))
    for name in ("softmax", "gla", "local", "lsh"):
        call = compiled(arrayattn.get_variant(name))
        assert isinstance(call, Executables)
        got = np.asarray(call(q, k, v))
        want = np.asarray(jax.jit(lambda q, k, v: call.call(q, k, v))(q, k, v))
        eps = np.finfo(np.float32).eps
        assert np.abs(got - want).max() <= 16 * eps * np.abs(want).max(), name
        call(q, k, v)
        assert len(call.programs) == 1, name         # one program for one set of shapes


def test_report_programs_leave_out_only_an_option_xla_lacks():
    """An XLA that does not know one of the options compiles with the others."""
    jax = pytest.importorskip("jax")
    from arrayattn.registry import jit_uniform
    from arrayattn.report.calls import Executables

    call = Executables(jit_uniform("softmax"), {"xla_backend_optimization_level": 1,
                                                 "xla_no_such_option_here": False})
    q = jax.numpy.ones((1, 2, 8, 4), jax.numpy.float32)
    assert np.allclose(np.asarray(call(q, q, q)), 1.0)
    assert call.options == {"xla_backend_optimization_level": 1}


def test_executables_pass_options_and_fall_back_only_for_unknown_ones():
    """``Executables`` hands its options to XLA; an XLA that does not know an option
    compiles without it (with the others), and any other compile error is raised."""
    from arrayattn.report.calls import Executables

    seen = []

    class Lowered:
        def __init__(self, error):
            self.error = error

        def compile(self, compiler_options=None):
            seen.append(compiler_options)
            if compiler_options and self.error:
                raise RuntimeError(self.error)
            return lambda q, k, v, drawn: ("ran", compiler_options)

    class Call:
        def __init__(self, error=None):
            self.error = error

        def lower(self, q, k, v):
            return Lowered(self.error)

        def drawn(self, q):
            return {}

    x = np.zeros((1, 2, 4, 3), np.float32)
    assert Executables(Call(), {"level": 1})(x, x, x) == ("ran", {"level": 1})
    assert seen == [{"level": 1}]
    seen.clear()
    unknown = Executables(Call("INVALID_ARGUMENT: No such compile option: 'level'"),
                          {"level": 1})
    assert unknown(x, x, x) == ("ran", None)
    assert seen == [{"level": 1}, None]
    seen.clear()

    class OneUnknown(Call):
        def lower(self, q, k, v):
            low = Lowered(None)
            inner = low.compile

            def compile(compiler_options=None):
                if compiler_options and "new" in compiler_options:
                    seen.append(compiler_options)
                    raise RuntimeError("INVALID_ARGUMENT: No such compile option: 'new'")
                return inner(compiler_options)
            low.compile = compile
            return low

    both = Executables(OneUnknown(), {"level": 1, "new": False})
    assert both(x, x, x) == ("ran", {"level": 1})     # the known one is kept
    assert seen == [{"level": 1, "new": False}, {"level": 1}]
    with pytest.raises(RuntimeError, match="out of memory"):
        Executables(Call("out of memory"), {"level": 1})(x, x, x)


def test_openblas_threads_are_set_and_restored():
    """``openblas_threads`` sets the OpenBLAS libraries SciPy's and NumPy's wheels ship
    (where found) and restores them from what it returned; the JAX report leaves them as
    it found them."""
    from arrayattn.report.calls import openblas_threads

    before = openblas_threads(None)
    if not before:
        pytest.skip("no OpenBLAS of a SciPy or NumPy wheel here")
    try:
        assert openblas_threads(1) == before
        assert set(openblas_threads(None).values()) == {1}
    finally:
        openblas_threads(before)
    assert openblas_threads(None) == before
    pytest.importorskip("jax")
    run_report(Workload(n=32, d=8, backend="jax", repeats=1), ["nystrom_svd"])
    assert openblas_threads(None) == before
