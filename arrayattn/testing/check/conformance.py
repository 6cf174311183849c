"""The conformance report (``arrayattn conformance FILE.md``): the kernel checker run on
every attention kernel this machine offers -- torch's SDPA with each backend, flex_attention
eager and compiled, ``jax.nn.dot_product_attention`` with each implementation, Hugging
Face's attention functions -- and one Markdown table of what each covered and found."""
from __future__ import annotations

import os
import sys
import time
import types
import warnings
from dataclasses import dataclass, replace

__all__ = ["Kernel", "Unavailable", "KERNELS", "run_kernel", "conformance", "table", "notes",
           "add_parser", "run_conformance", "Row"]


class Unavailable(Exception):
    """The kernel does not run on this machine (the reason)."""


@dataclass
class Kernel:
    """One kernel of the report: its ``name``, the ``convention`` it is called by,
    ``make()`` (the callable; :class:`Unavailable` when it does not run here) and a
    ``note`` on how it is called."""

    name: str
    convention: str
    make: object
    note: str = ""
    equal_dims: bool = False      # the kernel refuses d != dv: the cases keep dv = d

    def get_convention(self):
        """The convention the kernel is checked under (``dv = d`` with ``equal_dims``)."""
        from .conventions import get_convention
        conv = get_convention(self.convention)
        if self.equal_dims:
            normalize = conv.normalize

            def same_dims(case):
                case = normalize(case)
                return replace(case, dv=case.d)
            conv.equal_dims, conv.normalize = True, same_dims
        return conv


def _first_line(exc: BaseException) -> str:
    """``Type: the first sentence of the message`` (at most 90 characters)."""
    text = str(exc).strip().splitlines()
    first = text[0].split(". ")[0].rstrip(".") if text else ""
    return f"{type(exc).__name__}: {first[:90]}"


# -- torch SDPA, one backend at a time -------------------------------------------------
def _sdpa_backend(backend_name: str):
    def make():
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    with sdpa_kernel([backend]):
                        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
                except RuntimeError as exc:   # the backend does not take these inputs
                    if "No viable backend" in str(exc) or "No available kernel" in str(exc):
                        raise NotImplementedError(_first_line(exc)) from None
                    raise
        _probe_torch(kernel)
        kernel.__name__ = f"sdpa_{backend_name.lower()}"
        return kernel
    return make


def _probe_torch(kernel):
    """Unavailable unless ``kernel`` runs on the plainest float32 case."""
    import torch
    q = torch.randn(1, 2, 16, 16)
    try:
        kernel(q, q, q)
    except NotImplementedError as exc:
        raise Unavailable(str(exc)) from None
    except Exception as exc:
        raise Unavailable(_first_line(exc)) from None


def _sdpa_default():
    import torch
    return torch.nn.functional.scaled_dot_product_attention


# -- flex_attention ------------------------------------------------------------------------
def _flex(compiled: bool):
    def make():
        import torch
        from torch.nn.attention.flex_attention import flex_attention
        if not compiled:
            return flex_attention
        import torch._dynamo
        # every new shape recompiles; past dynamo's limit (8) it would run eager silently
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 10**4)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 10**5)
        fn = torch.compile(flex_attention)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for n in (16, 17):      # compiled, then recompiled with dynamic sizes,
                    q = torch.randn(1, 2, n, 16)      # outside the budget
                    fn(q, q, q)
        except Exception as exc:
            raise Unavailable(_first_line(exc)) from None
        return fn
    return make


# -- JAX -------------------------------------------------------------------------------
def _jax(implementation):
    def make():
        import functools
        import jax
        import jax.numpy as jnp
        fn = functools.partial(jax.nn.dot_product_attention, implementation=implementation)
        x = jnp.ones((1, 4, 2, 8), dtype=jnp.float32)
        try:
            fn(x, x, x)
        except Exception as exc:
            raise Unavailable(_first_line(exc)) from None
        return fn
    return make


# -- Hugging Face's attention functions, called as SDPA -------------------------------------
def _hf(which: str):
    def make():
        try:
            if which == "sdpa":
                from transformers.integrations.sdpa_attention import sdpa_attention_forward \
                    as forward
            else:
                from transformers.models.llama.modeling_llama import eager_attention_forward \
                    as forward
        except Exception as exc:
            raise Unavailable(_first_line(exc)) from None
        import torch

        def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
            if attn_mask is not None:        # the models' masks are (b, 1, n, s)
                attn_mask = attn_mask.expand(q.shape[0], 1, *attn_mask.shape[-2:])
            module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1],
                                           is_causal=is_causal, training=False)
            scaling = q.shape[-1] ** -0.5 if scale is None else scale
            if which == "sdpa":
                out, _ = forward(module, q, k, v, attn_mask, dropout=dropout_p,
                                 scaling=scaling, is_causal=is_causal)
            else:
                if is_causal:      # the models pass causality in the mask
                    raise NotImplementedError("is_causal: eager takes the causal mask")
                if attn_mask is not None and attn_mask.dtype == torch.bool:
                    # the models' bool -> additive conversion (finfo.min, not -inf)
                    attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(
                        ~attn_mask, torch.finfo(q.dtype).min)
                out, _ = forward(module, q, k, v, attn_mask, scaling=scaling,
                                 dropout=dropout_p)
            return out.transpose(1, 2)           # (b, n, h, d) -> SDPA's (b, h, n, d)
        _probe_torch(kernel)
        return kernel
    return make


#: The kernels of the report, in its order.
KERNELS = [
    Kernel("torch SDPA (default dispatch)", "sdpa", _sdpa_default,
           "torch.nn.functional.scaled_dot_product_attention"),
    Kernel("torch SDPA, MATH backend", "sdpa", _sdpa_backend("MATH"),
           "inside sdpa_kernel([SDPBackend.MATH])"),
    Kernel("torch SDPA, FLASH_ATTENTION backend", "sdpa", _sdpa_backend("FLASH_ATTENTION"),
           "inside sdpa_kernel([SDPBackend.FLASH_ATTENTION]); options it refuses: "
           "unsupported; d = dv only (refused on the CPU)", equal_dims=True),
    Kernel("torch SDPA, EFFICIENT_ATTENTION backend", "sdpa",
           _sdpa_backend("EFFICIENT_ATTENTION"), "sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])"),
    Kernel("torch SDPA, CUDNN_ATTENTION backend", "sdpa", _sdpa_backend("CUDNN_ATTENTION"),
           "sdpa_kernel([SDPBackend.CUDNN_ATTENTION])"),
    Kernel("torch flex_attention (eager)", "flex_attention", _flex(False),
           "torch.nn.attention.flex_attention.flex_attention"),
    Kernel("torch flex_attention (torch.compile)", "flex_attention", _flex(True),
           "torch.compile(flex_attention), warmed up on two sizes (dynamic sizes after that); "
           "every new score_mod/mask_mod recompiles (seconds on a CPU)"),
    Kernel("jax.nn.dot_product_attention (implementation=None)", "jax_dot_product_attention",
           _jax(None), "JAX's default choice"),
    Kernel("jax.nn.dot_product_attention (implementation='xla')",
           "jax_dot_product_attention", _jax("xla"), ""),
    Kernel("jax.nn.dot_product_attention (implementation='cudnn')",
           "jax_dot_product_attention", _jax("cudnn"), ""),
    Kernel("transformers sdpa_attention_forward", "sdpa", _hf("sdpa"),
           "called as SDPA: a module with num_key_value_groups, the mask as (b, 1, n, s), "
           "out transposed back"),
    Kernel("transformers eager_attention_forward (Llama)", "sdpa", _hf("eager"),
           "called as SDPA: the mask as (b, 1, n, s), bool masks made additive with finfo.min "
           "as the models do; "
           "is_causal unsupported (the models pass it in the mask)"),
]


@dataclass
class Row:
    """One kernel's line of the report."""

    kernel: Kernel
    result: object = None          # KernelCheck
    reason: str | None = None      # why it did not run
    repro: str | None = None


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")[:60]


def run_kernel(kernel: Kernel, *, budget: float, seed: int = 0, repro_dir: str | None = None,
               log=None) -> Row:
    """Check one kernel (its :class:`Row`; ``reason`` set when it is unavailable)."""
    from .api import check_kernel

    try:
        fn = kernel.make()
    except Unavailable as exc:
        return Row(kernel, reason=str(exc))
    except ImportError as exc:
        return Row(kernel, reason=_first_line(exc))
    repro = os.path.join(repro_dir, _slug(kernel.name) + ".npz") if repro_dir else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = check_kernel(fn, kernel.get_convention(), budget=budget, seed=seed,
                               repro=repro, log=log)
    except Exception as exc:     # e.g. a kernel refusing even the plainest case's shape
        return Row(kernel, reason="the checker stopped: " + _first_line(exc))
    return Row(kernel, res, repro=res.repro)


def conformance(kernels=None, *, budget: float = 10.0, seed: int = 0, repro_dir=None,
                log=None) -> list:
    """The rows of every kernel of ``kernels`` (default :data:`KERNELS`)."""
    rows = []
    for kernel in KERNELS if kernels is None else kernels:
        if log:
            log(f"{kernel.name} ...")
        rows.append(run_kernel(kernel, budget=budget, seed=seed, repro_dir=repro_dir,
                               log=log))
        if log and rows[-1].result is not None:
            r = rows[-1].result
            log(f"  {'ok' if r.ok else 'FOUND'}: {r.cases} cases in {r.seconds:.1f} s")
    return rows


def _option(text: str) -> str:
    """``"('is_causal', True)"`` -> ``is_causal=True`` (a dtype stays as it is)."""
    import ast
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return f"{value[0]}={value[1]}" if isinstance(value, tuple) and len(value) == 2 else text


def _short(error: str, limit: int = 240) -> str:
    """A kernel's error as a table cell: its first line, at most ``limit`` characters (a
    compiler's whole log stays in the repro file)."""
    first = error.split("  Command:")[0].splitlines()[0] if error else ""
    return first if len(first) <= limit else first[:limit - 3] + "..."


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(rows, *, relative_to: str | None = None) -> str:
    """The Markdown table of ``rows`` (repro paths relative to ``relative_to``)."""
    from .judge import ratio

    head = ("| kernel | convention | options covered | dtypes | cases | head dims; largest "
            "case | time (s) | verdict | worst error / tolerance | finding (smallest case; "
            "repro) |")
    lines = [head, "|" + "---|" * 10]
    for row in rows:
        k, r = row.kernel, row.result
        if r is None:
            lines.append(f"| {_cell(k.name)} | {k.convention} | | | | | | n/a: "
                         f"{_cell(row.reason)} | | |")
            continue
        cov = r.covered
        options = ", ".join(sorted(cov.get("options", ()))) or "none"
        if r.unsupported:
            options += "; unsupported: " + ", ".join(map(_option, r.unsupported))
        finding = ""
        if not r.ok:
            f = r.failure
            what = _short(f.verdict.error) if f.verdict.error else "; ".join(
                f"{label} at {ratio(c):.3g}x its tolerance" for label, c in f.verdict.failing())
            finding = f"{f.case.describe()}: {what}"
            if row.repro:
                path = os.path.relpath(row.repro, relative_to) if relative_to else row.repro
                finding += f"; `{path}`"
        worst = f"{r.worst_ratio:.3g}" if r.ok else (
            "raised" if r.failure.verdict.error else f"{r.failure.verdict.worst:.3g}")
        lines.append(f"| {_cell(k.name)} | {k.convention} | {_cell(options)} | "
                     f"{', '.join(sorted(cov.get('dtypes', ())))} | {r.cases} | "
                     f"{_sizes(cov)} | {r.seconds:.1f} | {'ok' if r.ok else 'FOUND'} | {worst} | "
                     f"{_cell(finding)} |")
    return "\n".join(lines) + "\n"


def _sizes(cov: dict) -> str:
    """``8-256; b=1 h=8 n=4096 s=4096 d=64 dv=64``: the head dims and the largest case."""
    dims = sorted(cov.get("dims", ()))
    span = "" if not dims else str(dims[0]) if len(dims) == 1 else f"{dims[0]}-{dims[-1]}"
    largest = cov.get("largest", (0, ""))[1]
    return _cell(f"{span}; {largest}" if largest else span)


def notes(rows) -> str:
    """How each kernel of ``rows`` is called (a Markdown list)."""
    lines = [f"- {row.kernel.name}: {row.kernel.note}" for row in rows if row.kernel.note]
    return "\nHow each kernel is called:\n\n" + "\n".join(lines) + "\n" if lines else ""


def _header(budget: float, seed: int) -> str:
    import platform
    versions = []
    for mod in ("torch", "jax", "transformers", "hypothesis"):
        m = sys.modules.get(mod)
        if m is not None and getattr(m, "__version__", None):
            versions.append(f"{mod} {m.__version__}")
    return (f"Conformance of the attention kernels on this machine ({platform.machine()}, "
            f"{platform.system()}, Python {platform.python_version()}; "
            f"{', '.join(versions)}): `arrayattn conformance`, budget {budget:g} s per "
            f"kernel, seed {seed}.  worst error / tolerance: the largest ratio over the "
            "cases judged (ok below 1).\n\n")


def add_parser(sub):
    """Register ``conformance`` on the subparsers ``sub``."""
    p = sub.add_parser(
        "conformance", help="run the checker on every attention kernel here: a Markdown "
        "table", description="Run 'arrayattn check' on every attention kernel this machine "
        "offers (torch SDPA backends, flex_attention eager and compiled, "
        "jax.nn.dot_product_attention implementations, transformers' attention "
        "functions) and write one Markdown table. Exit 0: written (findings included); "
        "2: usage.")
    p.add_argument("report", metavar="FILE.md")
    p.add_argument("--budget", type=float, default=10.0,
                   help="seconds of search per kernel (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", action="append", default=None, metavar="NAME",
                   help="repeatable; a kernel whose name contains NAME (default: all)")
    p.add_argument("--repro-dir", default=None, metavar="DIR",
                   help="where findings' repro files go (default FILE_repro/ beside FILE)")
    p.set_defaults(func=run_conformance)
    return p


def run_conformance(args) -> int:
    """The ``conformance`` command's runner; its exit code."""
    from .command import check_writable
    from .search import require_hypothesis

    try:
        require_hypothesis()
        if args.budget <= 0:
            raise ValueError(f"--budget must be > 0; got {args.budget}")
        check_writable("report", args.report)
        kernels = KERNELS
        if args.kernel:
            kernels = [k for k in KERNELS if any(s.lower() in k.name.lower()
                                                 for s in args.kernel)]
            if not kernels:
                raise ValueError(f"--kernel {', '.join(args.kernel)}: no such kernel; known: "
                                 + "; ".join(k.name for k in KERNELS))
    except (ValueError, ImportError) as exc:
        print(f"arrayattn conformance: error: {exc}", file=sys.stderr)
        return 2
    repro_dir = args.repro_dir or os.path.splitext(args.report)[0] + "_repro"
    os.makedirs(repro_dir, exist_ok=True)
    t0 = time.monotonic()
    rows = conformance(kernels, budget=args.budget, seed=args.seed, repro_dir=repro_dir,
                       log=lambda text: print(text, file=sys.stderr))
    text = _header(args.budget, args.seed) + table(
        rows, relative_to=os.path.dirname(os.path.abspath(args.report))) + notes(rows)
    with open(args.report, "w") as fh:
        fh.write(text)
    if not os.listdir(repro_dir) and not args.repro_dir:
        os.rmdir(repro_dir)
    print(text)
    print(f"written {args.report} ({len(rows)} kernels, {time.monotonic() - t0:.0f} s)",
          file=sys.stderr)
    return 0
