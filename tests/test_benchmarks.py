"""benchmarks/run.py on a tiny sweep: its outputs, the skip rule and the README update
(not timing assertions: the numbers depend on the machine)."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

import arrayattn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_benchmark(stem: str, name: str | None = None):
    """The script ``benchmarks/<stem>.py`` as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(
        name or stem, os.path.join(ROOT, "benchmarks", f"{stem}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run():
    return load_benchmark("run", "bench_run")


def test_predict_extrapolates_the_measured_growth(run):
    pts = [{"n": 100, "seconds": 1.0}, {"n": 200, "seconds": 4.0}]
    assert run._predict(pts, "seconds", 400) == pytest.approx(16.0)  # quadratic
    assert run._predict(pts[:1], "seconds", 300) == pytest.approx(9.0)  # assumed quadratic
    lin = [{"n": 100, "seconds": 1.0}, {"n": 200, "seconds": 2.0}]
    assert run._predict(lin, "seconds", 800) == pytest.approx(8.0)
    assert run._predict([], "seconds", 10) is None


def test_tiny_sweep_outputs(run, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason="the sweep writes run.png with matplotlib")
    monkeypatch.setattr(run, "HERE", str(tmp_path))  # the README it updates
    (tmp_path / "README.md").write_text(f"# B\n\n{run.MARK_BEGIN}\nold\n{run.MARK_END}\nkeep\n")
    out = tmp_path / "results"
    code = run.main(["--backends", "numpy,torch", "--n", "32,64", "--repeats", "1", "--matmul-size", "256",
                     "--variants", "softmax,softmax_blockwise", "--out", str(out),
                     "--update-readme", "--note", "test run"])
    assert code == 0
    data = json.loads((out / "run.json").read_text())
    assert data["matmul_flops_per_s"]["numpy"] > 0
    got = {(r["backend"], r["variant"], r["n"]) for r in data["results"]}
    assert {("numpy", v, n) for v in ("softmax", "softmax_blockwise") for n in (32, 64)} <= got
    numpy_pts = [r for r in data["results"] if r["backend"] == "numpy"]
    assert all(r["seconds"] > 0 and r["peak_bytes"] > 0 and r["exact_equiv_fraction"] > 0
               for r in numpy_pts)
    if importlib.util.find_spec("torch"):
        assert ("torch", "peer:torch.sdpa", 64) in got
        torch_pts = [r for r in data["results"] if r["backend"] == "torch"]
        assert all(r["memory"] in ("rss", "cuda") and r["peak_bytes"] >= 0
                   for r in torch_pts)
    md = (out / "run.md").read_text()
    assert "| softmax | " in md and "test run" in md
    assert (out / "run.png").read_bytes()[:4] == b"\x89PNG"
    readme = (tmp_path / "README.md").read_text()
    assert "old" not in readme and "| softmax | " in readme and readme.endswith("keep\n")


def test_budget_skips_larger_n(run, tmp_path):
    run.main(["--backends", "numpy", "--n", "32,64,128", "--repeats", "1", "--matmul-size", "256", "--variants",
              "softmax", "--out", str(tmp_path), "--max-seconds", "1e-9"])
    res = json.loads((tmp_path / "run.json").read_text())["results"]
    assert "seconds" in res[0]
    assert res[1]["skipped"].startswith("predicted ") and "> --max-seconds" in res[1]["skipped"]
    assert res[2]["skipped"] == "n=64 was skipped"


def test_every_registered_variant_is_benchmarked_by_default(run, tmp_path):
    run.main(["--backends", "numpy", "--n", "16", "--repeats", "1", "--matmul-size", "256", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "run.json").read_text())["results"]
    assert [r["variant"] for r in res] == [r.name for r in arrayattn.variants()]


def test_compare_before_after(tmp_path):
    """benchmarks/compare.py on a tiny problem, HEAD against the work tree."""
    import shutil
    import subprocess
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs a git checkout")
    def worktrees():
        return subprocess.run(["git", "-C", ROOT, "worktree", "list"], capture_output=True,
                              text=True).stdout
    before = worktrees()
    mod = load_benchmark("compare", "bench_compare")
    assert mod.main(["HEAD", "--rounds", "1", "--n", "256", "--heads", "1",
                     "--cases", "linear,nystrom", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "compare.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| linear")
            or line.startswith("| nystrom")]
    expected = [name for name in mod.CASES if "linear" in name or "nystrom" in name]
    assert len(rows) == len(expected) >= 4
    assert all(line.rstrip().endswith("x |") for line in rows)
    data = json.loads((tmp_path / "compare.json").read_text())
    assert all(t > 0 for side in data["seconds"].values() for ts in side.values() for t in ts)
    assert worktrees() == before  # the temporary worktree of the old revision is gone


def test_nystrom_peer_is_the_same_algorithm():
    """The torch reference that bench_nystrom times is the Nyström of arrayattn with the
    global pinv initialisation (float64: to rounding), so its time compares like with like."""
    torch = pytest.importorskip("torch")
    import numpy as np
    mod = load_benchmark("bench_nystrom")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 48, 8)) for _ in range(3))
    with torch.no_grad():
        port = mod.torch_port(*(torch.from_numpy(x) for x in (q, k, v)), 6).numpy()
    ours = arrayattn.nystrom_attention(q, k, v, num_landmarks=6, pinv_init="global")
    np.testing.assert_allclose(port, ours, rtol=0, atol=1e-10 * np.abs(v).max())
    assert not np.allclose(port, arrayattn.nystrom_attention(q, k, v, num_landmarks=6,
                                                              pinv_iters=2), atol=1e-6)


def test_bench_gated_smoke(tmp_path):
    """benchmarks/bench_gated.py on a tiny problem: every gated variant and the baseline
    on NumPy (and jitted JAX when installed), ratios to the baseline."""
    mod = load_benchmark("bench_gated")
    backends = "numpy,jax" if importlib.util.find_spec("jax") else "numpy"
    mod.main(["--n", "40", "--heads", "2", "--d", "8", "--repeats", "1",
              "--backends", backends, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "gated.json").read_text())
    names = {r["variant"] for r in data["rows"]}
    gated = {r.name for r in arrayattn.variants() if r.family == "gated"}
    assert gated <= names and len(names) == len(gated) + 1
    assert all(r["time_ms"] > 0 for r in data["rows"])
    assert (tmp_path / "gated.md").read_text().count("|") > 10


def test_bench_gpu_runs_on_the_cpu(tmp_path):
    """benchmarks/bench_gpu.py, unchanged, with a small n on whatever this machine has
    (CPU here): every case on NumPy, the other backends timed or skipped with a reason,
    and their difference from NumPy float32 at float32 rounding (no TF32 anywhere)."""
    mod = load_benchmark("bench_gpu")
    mod.main(["--n", "64", "--long-n", "128", "--heads", "2", "--d", "16", "--repeats", "1",
              "--backends", "numpy,torch,jax,cupy", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "gpu.json").read_text())["rows"]
    numpy_rows = [r for r in rows if r["backend"] == "numpy"]
    assert {r["case"] for r in numpy_rows} == set(mod.CASES)
    assert all(r.get("ms", 0) > 0 for r in numpy_rows), numpy_rows
    for r in rows:
        if r["backend"] != "numpy" and "rel_diff_vs_numpy" in r:
            # performer_trig-free cases: float32 rounding of sums of <= 128 terms
            assert r["rel_diff_vs_numpy"] < 1e-4, r
        assert "ms" in r or "note" in r
    assert any("skipped" in r.get("note", "") for r in rows if r["backend"] == "cupy")


def test_sparse_chunks_smoke(tmp_path):
    """benchmarks/sparse_chunks.py on a tiny problem: one row per budget, the budget put
    back afterwards, and the budgets really differ (the smaller one cuts more chunks)."""
    import arrayattn.core.devices as devices

    mod = load_benchmark("sparse_chunks")
    chosen = devices.CPU_CHUNK
    mod.main(["--variants", "local", "--sizes", "256", "--budgets", "10,20", "--heads", "2",
              "--repeats", "1", "--out", str(tmp_path / "sc")])
    assert devices.CPU_CHUNK == chosen
    rows = json.loads((tmp_path / "sc.json").read_text())["rows"]
    assert [r["budget"] for r in rows] == [10, 20]
    assert all(r["numpy_ms"] > 0 and r["numpy_peak_mb"] > 0 for r in rows)
    if "loops" in rows[0]:
        assert rows[0]["loops"] >= rows[1]["loops"]
    assert (tmp_path / "sc.md").read_text().count("| local |") == 2


def test_xla_inner_dim_smoke(tmp_path):
    """benchmarks/xla_inner_dim.py on two small shapes: a row per kernel and size."""
    pytest.importorskip("jax")
    mod = load_benchmark("xla_inner_dim")
    mod.main(["--dims", "8,64", "--rows", "4,8", "--out", str(tmp_path / "x")])
    rows = json.loads((tmp_path / "x.json").read_text())["rows"]
    assert len(rows) == 6 and all(r["compile_s"] > 0 and r["flat_compile_s"] > 0 for r in rows)
    assert (tmp_path / "x.md").read_text().count("| exp |") == 2


def test_chunk_states_smoke(tmp_path):
    """benchmarks/chunk_states.py on a tiny problem: both forms per size, the threshold
    put back, the cumulative sum's program with reduce-windows and no loop, the loop's
    the reverse."""
    pytest.importorskip("jax")
    from arrayattn.reference import scan as scan_module

    mod = load_benchmark("chunk_states")
    chosen = scan_module.XLA_CPU_CUMSUM_STEPS
    mod.main(["--variants", "linear_relu", "--sizes", "256", "--heads", "2",
              "--repeats", "1", "--out", str(tmp_path / "cs")])
    assert scan_module.XLA_CPU_CUMSUM_STEPS == chosen
    rows = json.loads((tmp_path / "cs.json").read_text())["rows"]
    assert [r["form"] for r in rows] == ["cumulative_sum", "loop"]
    assert rows[0]["loops"] == 0 and rows[1]["loops"] == 1
    assert rows[1]["reduce_windows"] < rows[0]["reduce_windows"]
    assert [r["in_code"] for r in rows] == ["yes", ""]



def test_report_xla_level_smoke(tmp_path):
    """benchmarks/report_xla_level.py on one variant: a row per report input shape and a
    total, both programs compiled and timed, their outputs compared."""
    pytest.importorskip("jax")
    mod = load_benchmark("report_xla_level")
    mod.main(["--variants", "softmax", "--repeats", "1", "--out", str(tmp_path / "r")])
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["softmax", "softmax", "**all**"]
    assert all(r["compile_default_s"] > 0 and r["run_level_ms"] > 0 for r in rows)
    assert all(r["max_rel_diff"] < 1e-5 for r in rows)
    assert (tmp_path / "r.md").read_text().count("| softmax |") == 2


def test_jit_compile_tables_take_a_bare_name(tmp_path):
    """benchmarks/jit_compile.py's ``--out``: a path stem, or a bare name that goes to
    ``benchmarks/results/`` (a bare name once crashed at the end of a 17-minute run)."""
    mod = load_benchmark("jit_compile")
    mod.HERE = str(tmp_path)
    row = {"variant": "gla", "n": 32, "compile_s": 0.5, "compile_cpu_s": 0.9,
           "run_ms": 1.0, "ops": 10, "loops": 1, "alarms": 0}
    meta = {"machine": {"cpu": "test", "cpus": 2, "load_average": (0.0, 0.0, 0.0)},
            "workload": "test", "sizes": [32], "reference_compile_s": 0.25,
            "compile_repeats": 2}
    table = mod.write_tables("jc", meta, {"compile_s": 0.25}, [row], ["gla"])
    assert "| gla | 10 | 1 | 0.50 s (0.90 cpu), 1 ms (2.0x) | 1.00 |" in table
    assert (tmp_path / "results" / "jc.md").read_text().strip().endswith(table.splitlines()[-1])
    mod.write_tables(str(tmp_path / "elsewhere" / "jc2"), meta, {}, [row], ["gla"])
    assert json.loads((tmp_path / "elsewhere" / "jc2.json").read_text())["rows"] == [row]


def test_report_jax_cache_smoke(tmp_path):
    """benchmarks/report_jax_cache.py on one variant: a cold run, one that fills JAX's
    persistent cache and one that reads every program back from it, with the same errors."""
    pytest.importorskip("jax")
    mod = load_benchmark("report_jax_cache")
    mod.main(["--variants", "linear_elu", "--rounds", "1", "--out", str(tmp_path / "c")])
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["cold", "fills the cache", "from the cache"]
    assert all(r["wall_s"] > 0 and r["cpu_s"] > 0 and r["peak_gb"] > 0 for r in rows)
    assert rows[0]["cache_entries"] == "" and rows[2]["cache_entries"] >= 2  # two shapes
    assert all(r["errors_identical"] for r in rows)


def test_regress_ab_smoke(tmp_path):
    """benchmarks/regress.py on one cheap variant and one tiny size, HEAD against the work
    tree: both sides measured, the table and JSON written, the temporary checkout gone."""
    import shutil
    import subprocess
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs a git checkout")
    def worktrees():
        return subprocess.run(["git", "-C", ROOT, "worktree", "list"], capture_output=True,
                              text=True).stdout
    before = worktrees()
    mod = load_benchmark("regress", "bench_regress")
    common = ["--base", "HEAD", "--names", "^linear_relu$", "--sizes", "64", "--heads", "1",
              "--calls", "1", "--confirm", "1", "--confirm-calls", "2",
              "--checkouts", str(tmp_path)]
    code = mod.main([*common, "--rounds", "2", "--out", str(tmp_path)])
    assert code in (0, 1)  # 1: a flagged case (timings of a tiny call are noise)
    data = json.loads((tmp_path / "regress.json").read_text())
    rows = data["rows"]
    assert [(r["variant"], r["n"], r["causal"]) for r in rows] == [
        ("linear_relu", 64, False), ("linear_relu", 64, True)]
    assert all(r["base"] > 0 and r["head"] > 0 and r["ratio"] > 0 for r in rows)
    assert all(len(r["base_rounds"]) == len(r["head_rounds"]) == 2 for r in rows)
    assert code == int(any(r["flag"] for r in rows))
    # a flag stands only where the rerun of that case also exceeds the factor
    assert all(r["flag"] <= ("rerun" in r and r["rerun"] > 1.05) for r in rows)
    md = (tmp_path / "regress.md").read_text()
    assert md.count("| linear_relu | 64 |") == 2 and "head/base" in md
    assert worktrees() == before and not list(tmp_path.glob("regress_*"))
    # --factor 0: every case flagged in the first pass, rerun, and flagged again
    code = mod.main([*common, "--rounds", "1", "--factor", "0", "--steady-malloc",
                     "--out", str(tmp_path / "f")])
    data = json.loads((tmp_path / "f" / "regress.json").read_text())
    rows = data["rows"]
    assert code == 1 and all(r["flag"] and r["rerun"] > 0 and r["rerun_paired"] > 0
                             for r in rows)
    assert data["steady_malloc"] and "malloc: steady" in (tmp_path / "f" / "regress.md").read_text()
    children = [x for side in ("raw", "confirm_raw") for runs in data[side].values()
                for results in runs.values() for x in results]
    assert children and all(x["malloc"] == mod.STEADY_MALLOC for x in children)
    md = (tmp_path / "f" / "regress.md").read_text()
    assert "**2 of 2 cases flagged** (2 over 0 in the first pass" in md and "| rerun |" in md
    assert worktrees() == before and not list(tmp_path.glob("regress_*"))


def test_asv_suite_names_registered_variants():
    """The asv suite imports (against the work tree), every parametrised benchmark's
    variant list is the registry's, and one cheap case runs through setup and the timed
    call; an unknown name or an unsupported causal form is skipped (NotImplementedError)."""
    mod = load_benchmark("asv_bench/bench_attention", "bench_asv_attention")
    names = [r.name for r in arrayattn.variants()]
    suites = [obj for obj in vars(mod).values()
              if isinstance(obj, type) and getattr(obj, "params", None)
              and any(a.startswith(("time_", "peakmem_", "track_")) for a in dir(obj))]
    assert {c.__name__ for c in suites} >= {"Forward", "ForwardMemory", "VJP",
                                            "JaxCompile", "JaxCompileUniform"}
    for cls in suites:
        assert cls.param_names[0] == "variant"
        assert list(cls.params[0]) == names, cls.__name__
    assert mod.Forward.params[1] == [4096, 16384]
    fwd = mod.Forward()
    fwd.setup("linear_relu", 4096, True)
    fwd.time_forward("linear_relu", 4096, True)
    with pytest.raises(NotImplementedError):
        mod.Forward().setup("no_such_variant", 4096, False)
    plain_only = next(r.name for r in arrayattn.variants() if not r.causal)
    with pytest.raises(NotImplementedError):
        mod.Forward().setup(plain_only, 4096, True)
    vjp = mod.VJP()
    vjp.setup("linear_relu", 1024, False)
    vjp.time_vjp("linear_relu", 1024, False)


def test_asv_suite_jax_compile_track():
    pytest.importorskip("jax")
    mod = load_benchmark("asv_bench/bench_attention", "bench_asv_attention")
    for cls, meth in ((mod.JaxCompile, "track_jax_compile_jit"),
                      (mod.JaxCompileUniform, "track_jax_compile_uniform")):
        bench = cls()
        bench.n = 16
        bench.setup("linear_relu")
        assert getattr(bench, meth)("linear_relu") > 0


def test_asv_conf_names_the_suite():
    asv_util = pytest.importorskip("asv.util")
    conf = asv_util.load_json(os.path.join(ROOT, "benchmarks", "asv.conf.json"),
                              js_comments=True)
    assert conf["repo"] == ".." and conf["environment_type"] == "virtualenv"
    assert os.path.isdir(os.path.join(ROOT, "benchmarks", conf["benchmark_dir"]))
    assert set(conf["matrix"]["req"]) >= {"numpy", "scipy", "array-api-compat",
                                          "array-api-extra", "jax", "torch", "hypothesis"}


def test_asv_check_suite_runs_one_cheap_case_of_each(monkeypatch):
    """benchmarks/asv_bench/bench_check.py (the checker's price): every benchmark class
    runs one cheap case through setup and its measured call; the clean kernels pass the
    search, each broken kernel is found (its time to a finding > 0), and the judge of a
    prepared call returns.  Fails on a suite that asv could not run (a clean kernel
    flagged raises, a broken kernel not found raises)."""
    pytest.importorskip("torch")
    pytest.importorskip("hypothesis")
    mod = load_benchmark("asv_bench/bench_check", "bench_asv_check")
    suites = {name: getattr(mod, name) for name in ("Catalogue", "CheckSearch",
                                                    "TimeToFinding", "Judge")}
    for cls in suites.values():
        assert any(a.startswith(("time_", "track_")) for a in dir(cls))
        assert len(cls.params) == len(cls.param_names)
    cat = mod.Catalogue()
    cat.setup("sdpa", "backward", "float32")
    assert cat.cases and all(c.opts.get("backward") for c in cat.cases)
    cat.time_catalogue("sdpa", "backward", "float32")
    monkeypatch.setattr(mod, "SEARCH_BUDGET", 0.5)
    search = mod.CheckSearch()
    search.setup("flash_attn", "forward", "float32")
    assert 0 < search.track_seconds_per_case("flash_attn", "forward", "float32") < 0.5
    monkeypatch.setattr(mod, "FINDING_BUDGET", 5.0)
    for label, dtype in (("sdpa bottom_right", "float32"), ("flash_attn fp16_pv", "float16")):
        ttf = mod.TimeToFinding()
        ttf.setup(label, dtype)
        assert 0 <= ttf.track_time_to_finding(label, dtype) < 5.0
    with pytest.raises(NotImplementedError):
        mod.TimeToFinding().setup("flash_attn fp16_pv", "float32")
    judge = mod.Judge()
    judge.setup("1x2x16x16", "backward", "float16")
    judge.time_judge("1x2x16x16", "backward", "float16")


def test_asv_check_suite_skips_without_the_checker(monkeypatch):
    """Without Hypothesis (or torch, or a revision without the checker) every benchmark of
    bench_check.py is skipped (NotImplementedError: asv's n/a), not failed."""
    import sys
    mod = load_benchmark("asv_bench/bench_check", "bench_asv_check")
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis -> ImportError
    for cls, args in ((mod.Catalogue, ("sdpa", "forward", "float32")),
                      (mod.CheckSearch, ("sdpa", "forward", "float32")),
                      (mod.TimeToFinding, ("sdpa bottom_right", "float32")),
                      (mod.Judge, ("1x2x16x16", "forward", "float32"))):
        with pytest.raises(NotImplementedError, match="checker cannot run"):
            cls().setup(*args)
