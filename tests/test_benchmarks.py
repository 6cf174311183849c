"""The runners of benchmarks/ on tiny problems (not timing assertions: the numbers depend
on the machine): run.py's sweep, skip rule and README update; compare.py, bench_gpu.py and
regress.py; the asv suite (bench_attention.py, bench_check.py) and its configuration; and
benchmarks/ as one suite of runners whose files every reference names correctly."""
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
    def worktrees():  # their paths: other checkouts of the repository commit meanwhile
        out = subprocess.run(["git", "-C", ROOT, "worktree", "list", "--porcelain"],
                             capture_output=True, text=True).stdout
        return {line for line in out.splitlines() if line.startswith("worktree ")}
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


def test_regress_ab_smoke(tmp_path):
    """benchmarks/regress.py on one cheap variant and one tiny size, HEAD against the work
    tree: both sides measured, the table and JSON written, the temporary checkout gone."""
    import shutil
    import subprocess
    if shutil.which("git") is None or subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("needs a git checkout")
    def worktrees():  # their paths: other checkouts of the repository commit meanwhile
        out = subprocess.run(["git", "-C", ROOT, "worktree", "list", "--porcelain"],
                             capture_output=True, text=True).stdout
        return {line for line in out.splitlines() if line.startswith("worktree ")}
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
                                                    "TimeToFinding", "Judge",
                                                    "SampledJudge")}
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
    from arrayattn.testing.check import sampling
    monkeypatch.setattr(sampling, "SAMPLE_ABOVE", 2 ** 12)
    sampled = mod.SampledJudge()
    sampled.setup("1x2x128x16", "backward", "float32")   # raises unless judged on rows
    sampled.time_judge("1x2x128x16", "backward", "float32")


def test_asv_check_suite_skips_without_the_checker(monkeypatch):
    """Without Hypothesis (or torch, or a revision without the checker) every benchmark of
    bench_check.py is skipped (NotImplementedError: asv's n/a), not failed."""
    import sys
    mod = load_benchmark("asv_bench/bench_check", "bench_asv_check")
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis -> ImportError
    for cls, args in ((mod.Catalogue, ("sdpa", "forward", "float32")),
                      (mod.CheckSearch, ("sdpa", "forward", "float32")),
                      (mod.TimeToFinding, ("sdpa bottom_right", "float32")),
                      (mod.Judge, ("1x2x16x16", "forward", "float32")),
                      (mod.SampledJudge, ("1x2x16x16", "forward", "float32"))):
        with pytest.raises(NotImplementedError, match="checker cannot run"):
            cls().setup(*args)


def test_benchmarks_holds_only_the_runners():
    """benchmarks/ is one suite (issue #52): every script in it is a runner that the
    README's table of runners names (``_measure.py``: their shared helpers), and every
    module of the asv suite is described there too.  Fails when a one-off script is added
    beside the runners without becoming one (its numbers go to a results page)."""
    import re
    bench = os.path.join(ROOT, "benchmarks")
    readme = open(os.path.join(bench, "README.md"), encoding="utf-8").read()
    table = readme[readme.index("## The runners"):readme.index("## Results pages")]
    named = set(re.findall(r"^\| `(\w+\.py)`", table, re.M))
    scripts = {f for f in os.listdir(bench) if f.endswith(".py")} - {"_measure.py"}
    assert scripts == named, (scripts ^ named)
    suite = {f for f in os.listdir(os.path.join(bench, "asv_bench"))
             if f.endswith(".py") and f != "__init__.py"}
    assert suite and all(f"asv_bench/{f}" in readme for f in suite)


def test_references_to_benchmark_files_exist():
    """Every ``benchmarks/<script>.py`` and ``benchmarks/results/<page>`` named in the
    docs, the README, the package, the tests and the runners exists: a removed script or a
    merged results page leaves no dangling reference (the results pages themselves quote
    the commands of their time and are not scanned)."""
    import re
    roots = ["docs", "arrayattn", "tests", "benchmarks"]
    files = [os.path.join(ROOT, "README.md")]
    for top in roots:
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("results", ".asv", "_build", "__pycache__")]
            files += [os.path.join(folder, n) for n in names
                      if n.endswith((".py", ".rst", ".md", ".json"))]
    pattern = re.compile(r"benchmarks/((?:asv_bench/)?\w+\.py|results/[\w.-]+\.(?:md|json|txt))")
    missing = set()
    for path in files:
        text = open(path, encoding="utf-8").read()
        for ref in pattern.findall(text):
            if not os.path.exists(os.path.join(ROOT, "benchmarks", ref)):
                missing.add((os.path.relpath(path, ROOT), ref))
    assert not missing, sorted(missing)


def test_check_speed_smoke(tmp_path):
    """benchmarks/check_speed.py on one convention at small budgets: the zoo's broken
    ``sdpa`` kernel found, the clean kernels (the zoo's and torch's own SDPA) not flagged,
    the page written to ``--out`` (before ``--out`` and ``--conventions`` it ran the whole
    zoo and wrote into benchmarks/results/)."""
    pytest.importorskip("torch")
    pytest.importorskip("hypothesis")
    mod = load_benchmark("check_speed", "bench_check_speed")
    assert mod.main(["--budget", "5", "--clean-budget", "0.5", "--seeds", "1",
                     "--conventions", "sdpa", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "check_speed.md").read_text()
    assert "| sdpa | bottom_right | " in md and "missed" not in md
    assert "| sdpa | 0 | " in md and "FLAGGED" not in md
    assert "flash_attn" not in md


def test_asv_check_suite_skips_an_older_checker(monkeypatch):
    """Catalogue and Judge use the checker's internal modules: where a revision's differ
    (here: ``judge`` taking other arguments), their setup skips (NotImplementedError)
    instead of failing the asv run."""
    pytest.importorskip("torch")
    pytest.importorskip("hypothesis")
    import arrayattn.testing.check.judge as judge_module
    mod = load_benchmark("asv_bench/bench_check", "bench_asv_check")
    monkeypatch.setattr(judge_module, "judge", lambda call: None)
    with pytest.raises(NotImplementedError, match="checker differs"):
        mod.Judge().setup("1x2x16x16", "forward", "float32")
