"""asv benchmarks: the price of ``arrayattn check`` (issue #52, point 2).

What a change to the judge or the search costs, measured as the checker's users meet it:

* :class:`Catalogue` -- ``time_catalogue``: run and judge the convention's fixed catalogue
  (:func:`arrayattn.testing.check.cases.catalogue`, the cases every check visits first) on
  a clean kernel, forward cases or backward cases, float32 or float16.  The same cases at
  every revision: the deterministic figure for the judge's price per case (divide by the
  case count, :data:`CATALOGUE_SIZES` at the time of writing).
* :class:`CheckSearch` -- ``track_seconds_per_case``: :func:`arrayattn.testing.check_kernel`
  on a clean kernel for :data:`SEARCH_BUDGET` seconds, seed 0, one dtype, with or without
  gradients: wall seconds per case of the whole search (catalogue, Hypothesis draws,
  bookkeeping), the inverse of its cases per second.  Seconds per case, not cases per
  second: asv reads a larger number as worse.
* :class:`TimeToFinding` -- ``track_time_to_finding``: the seconds ``check_kernel`` takes
  to its first finding (``KernelCheck.time_to_finding``; the shrinking after it not
  counted) on a deliberately broken kernel, seed 0, one dtype: forward bugs that the
  catalogue finds past its middle (grouped query heads mapped ``i % hkv``) and that only
  the random draws find (softcap after ALiBi), a backward-only bug (dk without the softmax
  scale), a half-precision-only bug (P V accumulated in float16) and, in the ``sdpa``
  convention, ``is_causal`` aligned bottom-right (found by the catalogue's first causal
  case: its time is the search's fixed cost).
* :class:`Judge` -- ``time_judge``: :func:`arrayattn.testing.check.judge.judge` alone on a
  prepared SDPA call (torch's own kernel already run), forward or backward, float32 or
  float16, at a small shape ``(1, 2, 16, 16)`` and a kernel-sized one ``(1, 8, 1024, 64)``.
* :class:`SampledJudge` -- ``time_judge``: the sampled judge past ``SAMPLE_ABOVE`` logits
  at ``(1, 8, 4096, 64)`` float32, forward (sampled rows) and backward (rows and key
  columns).

The kernels: torch's own ``scaled_dot_product_attention`` (convention ``sdpa``) and
:func:`flash_attn_func` below, a pure-torch kernel with ``flash_attn_func``'s signature and
semantics (convention ``flash_attn``; a copy of the clean kernel of the test suite's zoo,
``tests/testing/check/zoo.py``, so that asv imports this module on its own), with the bugs
the finding benchmarks switch on.  Torch runs with its default threads, as a user's does.

A revision without :mod:`arrayattn.testing.check`, or an environment without torch or
Hypothesis (the ``check`` extra), skips these benchmarks (``NotImplementedError`` in
``setup``: asv's ``n/a``).  Cost: ``asv run --python=same --quick --bench bench_check`` (one
sample each) took 4 min 17 s on the 2-core machine shared with six other jobs (2026-11-29);
the kernel-sized backward judge is most of it (0.6 s a call on a quiet machine, 14-19 s
then), with the search tracks (8 x ``SEARCH_BUDGET`` s) and the finding tracks (~25 s).
"""
from __future__ import annotations

import functools
import warnings

#: Seconds of search per ``CheckSearch.track_seconds_per_case`` (small: the rate, not a verdict)
SEARCH_BUDGET = 3.0
#: Budget of a finding benchmark; a bug not found within it fails the benchmark
FINDING_BUDGET = 30.0
SEED = 0
DTYPES = ["float32", "float16"]
#: Cases of the catalogue (clean kernels, gradients on) when this suite was written
CATALOGUE_SIZES = {("flash_attn", "forward"): 53, ("flash_attn", "backward"): 9,
                   ("sdpa", "forward"): 32, ("sdpa", "backward"): 6}


def _require_checker():
    """``(torch, check module)``, or ``NotImplementedError`` (asv: skipped) where this
    revision or environment lacks the checker, torch or Hypothesis."""
    try:
        import hypothesis  # noqa: F401  (the checker's search needs it)
        import torch

        import arrayattn.testing.check as check
        from arrayattn.testing.check import cases, judge, search  # noqa: F401
    except ImportError as exc:
        raise NotImplementedError(f"the checker cannot run here: {exc}") from None
    warnings.filterwarnings("ignore")
    return torch, check


# -- the kernels ------------------------------------------------------------------------
def _visible(torch, n, s, causal, window, bug):
    """FlashAttention's visibility, causal and windows aligned bottom-right, (n, s) bool."""
    i = torch.arange(n)[:, None]
    j = torch.arange(s)[None, :]
    off = 0 if bug == "causal_top_left" else s - n
    vis = torch.ones(n, s, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if left is not None and left >= 0:
        vis &= j >= i + off - left
    if right is not None and right >= 0:
        vis &= j <= i + off + right
    return vis


def _attend(torch, q, k, v, *, scale, vis, softcap, alibi, causal_alibi, bug):
    """Softmax attention of ``(b, h, n, d)`` in float32 (``bug="fp16_pv"``: P V summed in
    float16, key by key); returns ``(out, lse)``, FlashAttention's for empty rows (zeros,
    lse +inf)."""
    dt = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    hq, hkv = q.shape[1], k.shape[1]
    idx = torch.arange(hq) % hkv if bug == "gqa_mod" else torch.arange(hq) // (hq // hkv)
    k, v = k[:, idx], v[:, idx]
    s = q @ k.transpose(-1, -2) * scale
    n, m = s.shape[-2:]
    if m == 0:
        return (torch.zeros(*q.shape[:-1], v.shape[-1]).to(dt),
                torch.full(q.shape[:-1], float("inf")))
    if softcap and bug != "softcap_after_mask":
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        i = torch.arange(n)[:, None] + (m - n)
        dist = (i - torch.arange(m)[None, :]).abs().float()
        if causal_alibi:  # FlashAttention's causal kernel adds +slope j (same softmax)
            dist = -torch.arange(m)[None, :].float().expand(n, m)
        slopes = alibi.float()
        slopes = slopes[None, :, None, None] if alibi.ndim == 1 else slopes[:, :, None, None]
        s = s - slopes * dist
    s = s.masked_fill(~vis, float("-inf"))
    if softcap and bug == "softcap_after_mask":  # -inf stays -inf: wrong with ALiBi only
        s = softcap * torch.tanh(s / softcap)
    mx = s.amax(-1, keepdim=True)
    empty = torch.isinf(mx)
    safe = torch.where(empty, torch.zeros_like(mx), mx)
    p = torch.exp(s - safe)
    den = torch.where(empty, torch.ones_like(mx), p.sum(-1, keepdim=True))
    if bug == "fp16_pv" and dt == torch.float16:
        acc = torch.zeros(*p.shape[:-1], v.shape[-1], dtype=torch.float16)
        for j in range(m):
            acc = acc + (p[..., j:j + 1] * v[..., j:j + 1, :]).half()
        out = acc.float() / den
    else:
        out = (p @ v) / den
    lse = torch.where(empty[..., 0], torch.full_like(den[..., 0], float("inf")),
                      (torch.log(den) + safe)[..., 0])
    return out.to(dt), lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, bug=None):
    """``flash_attn_func`` of FlashAttention 2 in pure torch: ``(b, n, h, d)`` inputs, GQA,
    causal and windows aligned bottom-right, softcap, ALiBi, the lse through
    ``return_attn_probs``.  ``bug``: ``None`` (clean), ``"gqa_mod"`` (query head ``i``
    reads key head ``i % hkv``), ``"softcap_after_mask"`` (the softcap applied after the
    mask and ALiBi), ``"dk_missing_scale"`` (dk lacks the softmax scale), ``"fp16_pv"``
    (P V accumulated in float16) or ``"causal_top_left"``.

    >>> import torch
    >>> q = torch.randn(1, 5, 2, 8)
    >>> flash_attn_func(q, q, q, causal=True).shape
    torch.Size([1, 5, 2, 8])
    """
    import torch
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    n, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = softmax_scale or d ** -0.5
    if bug == "dk_missing_scale":  # the forward unchanged, dk = (its gradient) / scale
        k = k.detach() + (k - k.detach()) / scale
    left = window_size[0]
    out, lse = _attend(torch, q, k, v, scale=scale,
                       vis=_visible(torch, n, s, causal, window_size, bug), softcap=softcap,
                       alibi=alibi_slopes, bug=bug,
                       causal_alibi=(bool(causal) or window_size[1] == 0)  # mha_fwd's test
                       and (left is None or left < 0 or left >= s))
    out = out.transpose(1, 2)
    return (out, lse, None) if return_attn_probs else out


def sdpa_bottom_right(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    """torch's SDPA with ``is_causal`` aligned bottom-right (FlashAttention's) instead of
    top-left: a bug the ``sdpa`` convention catches where ``n != s``."""
    import torch
    if is_causal:
        n, s = q.shape[-2], k.shape[-2]
        keep = torch.ones(n, s, dtype=torch.bool).tril(s - n)
        if attn_mask is None:
            attn_mask = keep
        elif attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & keep
        else:
            attn_mask = attn_mask.masked_fill(~keep, float("-inf"))
        is_causal = False
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa)


def _clean_kernel(torch, convention: str):
    if convention == "sdpa":
        return torch.nn.functional.scaled_dot_product_attention
    return flash_attn_func


#: label -> (convention, bug) of the finding benchmarks
FINDINGS = {
    "flash_attn gqa_mod": ("flash_attn", "gqa_mod"),
    "flash_attn softcap_after_mask": ("flash_attn", "softcap_after_mask"),
    "flash_attn dk_missing_scale": ("flash_attn", "dk_missing_scale"),
    "flash_attn fp16_pv": ("flash_attn", "fp16_pv"),
    "sdpa bottom_right": ("sdpa", "bottom_right"),
}


def _broken_kernel(convention: str, bug: str):
    if convention == "sdpa":
        return sdpa_bottom_right
    return functools.partial(flash_attn_func, bug=bug)


def _internal(setup):
    """A ``setup`` that uses the checker's internal modules: where this revision's differ
    (an older checker), ``NotImplementedError`` (asv: skipped), not a failure."""
    @functools.wraps(setup)
    def wrapped(self, *params):
        try:
            return setup(self, *params)
        except (TypeError, AttributeError, ImportError) as exc:
            raise NotImplementedError(f"this revision's checker differs: {exc!r}") from None
    return wrapped


# -- the benchmarks ---------------------------------------------------------------------
class Catalogue:
    """The fixed catalogue of a convention, run and judged on its clean kernel."""

    params = (["flash_attn", "sdpa"], ["forward", "backward"], DTYPES)
    param_names = ["convention", "pass", "dtype"]
    timeout = 300.0

    @_internal
    def setup(self, convention, pass_, dtype):
        torch, check = _require_checker()
        from arrayattn.testing.check.cases import catalogue
        from arrayattn.testing.check.search import Search
        conv = check.get_convention(convention, "cpu")
        backward = pass_ == "backward"
        self.cases = [c for c in catalogue(conv, (dtype,), True)
                      if bool(c.opts.get("backward")) == backward]
        self.search = Search(_clean_kernel(torch, convention), conv)
        for case in self.cases[:2]:  # torch's and the reference's first-call costs
            self.search.evaluate(case)

    def time_catalogue(self, convention, pass_, dtype):
        for case in self.cases:
            self.search.evaluate(case)


class CheckSearch:
    """``check_kernel`` on a clean kernel for ``SEARCH_BUDGET`` seconds: seconds per case."""

    params = (["flash_attn", "sdpa"], ["forward", "backward"], DTYPES)
    param_names = ["convention", "grads", "dtype"]
    unit = "seconds per case"
    timeout = 120.0

    def setup(self, convention, pass_, dtype):
        torch, self.check = _require_checker()
        self.fn = _clean_kernel(torch, convention)

    def track_seconds_per_case(self, convention, pass_, dtype):
        """``pass_ == "backward"``: gradients on (the search draws forward and backward
        cases, as a user's default check does); ``"forward"``: ``grads=False``."""
        res = self.check.check_kernel(self.fn, convention, budget=SEARCH_BUDGET, seed=SEED,
                                      dtypes=[dtype], grads=pass_ == "backward")
        if not res.ok:  # a finding on a clean kernel: a referee change, not a speed
            raise RuntimeError(f"clean {convention} kernel flagged:\n{res.summary()}")
        return res.seconds / max(res.cases, 1)


class TimeToFinding:
    """Seconds of ``check_kernel`` to its first finding on a broken kernel, one dtype."""

    params = (list(FINDINGS), DTYPES)
    param_names = ["kernel", "dtype"]
    unit = "seconds"
    timeout = 300.0

    def setup(self, label, dtype):
        _, self.check = _require_checker()
        convention, bug = FINDINGS[label]
        if bug == "fp16_pv" and dtype != "float16":
            raise NotImplementedError("a float16-only bug")
        self.convention, self.fn = convention, _broken_kernel(convention, bug)

    def track_time_to_finding(self, label, dtype):
        res = self.check.check_kernel(self.fn, self.convention, budget=FINDING_BUDGET,
                                      seed=SEED, dtypes=[dtype])
        if res.ok:
            raise RuntimeError(f"{label} ({dtype}) not found within {FINDING_BUDGET:g} s")
        return res.time_to_finding


class Judge:
    """The judge alone on a prepared ``sdpa`` call of torch's own kernel."""

    params = (["1x2x16x16", "1x8x1024x64"], ["forward", "backward"], DTYPES)
    param_names = ["shape", "pass", "dtype"]
    timeout = 300.0
    # the kernel-sized backward judge takes about 0.5 s a call: one call a sample, up to
    # 5 samples within 10 s
    number = 1
    repeat = (1, 5, 10.0)
    warmup_time = 0.0

    @_internal
    def setup(self, shape, pass_, dtype):
        torch, check = _require_checker()
        from arrayattn.testing.check.cases import Case
        b, h, n, d = map(int, shape.split("x"))
        backward = pass_ == "backward"
        self.conv = check.get_convention("sdpa", "cpu")
        case = self.conv.normalize(Case(b=b, hq=h, hkv=h, n=n, s=n, d=d, dv=d, dtype=dtype)
                                   .with_options(backward=backward))
        self.call = self.conv.build(case)
        self.results, self.grads = self.conv.run(
            torch.nn.functional.scaled_dot_product_attention, self.call, case, backward)
        from arrayattn.testing.check.judge import judge
        self.judge = judge
        verdict = judge(self.call, self.conv, self.results, self.grads)  # and warms up
        if not verdict.ok:
            raise RuntimeError(f"torch's SDPA judged a mismatch at {case.describe()}")

    def time_judge(self, shape, pass_, dtype):
        self.judge(self.call, self.conv, self.results, self.grads)



class SampledJudge(Judge):
    """The sampled judge (:func:`arrayattn.testing.check.sampled.judge_case`) on a prepared
    ``sdpa`` call of torch's own kernel past ``SAMPLE_ABOVE`` logits: forward on sampled
    rows; backward on the rows (dq) and sampled key columns (dk, dv: the float64 forward of
    every row's rest is most of it)."""

    params = (["1x8x4096x64"], ["forward", "backward"], ["float32"])
    timeout = 600.0
    repeat = (1, 3, 30.0)

    @_internal
    def setup(self, shape, pass_, dtype):
        torch, check = _require_checker()
        try:
            from arrayattn.testing.check.sampled import judge_case
        except ImportError as exc:
            raise NotImplementedError(f"no sampled gradients here: {exc}") from None
        from arrayattn.testing.check.cases import Case
        b, h, n, d = map(int, shape.split("x"))
        backward = pass_ == "backward"
        self.conv = check.get_convention("sdpa", "cpu")
        self.case = self.conv.normalize(Case(b=b, hq=h, hkv=h, n=n, s=n, d=d, dv=d,
                                             dtype=dtype).with_options(backward=backward))
        self.call = self.conv.build(self.case)
        self.results, self.grads = self.conv.run(
            torch.nn.functional.scaled_dot_product_attention, self.call, self.case, backward)
        self.judge = judge_case
        verdict = judge_case(self.case, self.call, self.conv, self.results, self.grads)
        if not verdict.ok or not verdict.items[0][0].endswith(" rows)"):
            raise RuntimeError(f"torch's SDPA not judged OK on sampled rows at "
                               f"{self.case.describe()}")

    def time_judge(self, shape, pass_, dtype):
        self.judge(self.case, self.call, self.conv, self.results, self.grads)
