"""Tuning on first use: a GPU without a tuned table of its own can measure its launch configs once
per shape and keep them in an on-disk cache. Opt-in: nothing here runs unless
``RECFUSE_AUTOTUNE=1``.

With it set, the first config lookup (`configs.forward_config` / `configs.backward_config`, i.e.
the first launch plan) of a (kind, D, H, dtype) on a CUDA device tunes it, unless the cache
(`configs.cache_path`) or this GPU model's own shipped table already has that shape's entry:

* inputs: synthetic, of the shape's D / H / dtype, torchrec layout (a [B, F*D] buffer viewed as
  [B, F, D], feature_dim=1), shared [H, D] weight with an [H] bias, per-feature LayerNorm affine,
  F = 64 and x about 64 MB (B a multiple of 64), from a private ``torch.Generator`` (the caller's
  RNG state is untouched); the backward reads the forward's saved row stats, as a training step does;
* candidates: the heuristic's config, the config the shipped tables would give (if different),
  then at most `MAX_CANDIDATES` of `tuning.forward_candidates` / `tuning.backward_candidates`
  spread over kernel paths and knobs (`tuning.spread`); each round-tripped through its table entry
  (`configs.config_to_entry` / `config_from_entry`), so what is measured is what a lookup returns;
* each candidate runs once, is checked against the float64 composite (relative error in norm under
  `TOLERANCE`; grad_y zeroed where the float64 z is within `RELU_TIE` of 0, as the CLI tuner
  does), then timed with ``triton.testing.do_bench``; one that fails to compile or to check is
  dropped. The `FINALISTS` fastest are timed again at `CONFIRM_SCALE` times the batch (x about
  256 MB), with and without the LayerNorm affine (`CONFIRM_AFFINE`, the two times summed), and
  ranked by their worse ratio to the best at either size (`tuning.confirm_at_scale`, as the CLI
  tuner ranks); the first in that order must also be right at a masked batch (F=3,
  B=1000), else the next one;
* the winner goes into the cache file (same schema as `tuned/<gpu>.json`), merged with what the
  file holds (another process may have written it) under a file lock, written atomically (temp
  file + ``os.replace``). Logged at INFO: the shape, the time it took, heuristic vs winner.

Never tuned: with ``RECFUSE_AUTOTUNE`` unset (the default) or ``RECFUSE_TUNED_TABLE`` set; on CPU
or under the Triton interpreter (`tune_shape` can still be called directly there: the tests do);
inside a `configs.override` block; while a CUDA graph is captured or torch.compile traces; from
inside a tuning run; and a shape this process tried already, whether it succeeded or failed.
One lock: a second thread's lookup waits for a running tuning. Tuning takes the compile time of
up to 14 kernel variants per shape and kind (seconds each on a GPU) plus roughly 1-1.5 GB of GPU
memory for the inputs and the float64 references, and ~0.5 GB for the finalists' larger batch
(estimates: not measured end to end), freed
afterwards; a failure (e.g. out of memory) is logged and the shape keeps its table or heuristic
config for this process.

Example:
    >>> import torch
    >>> on_lookup("forward", 256, 1, torch.float32, "cpu")  # off by default, and never on CPU
    >>> tuning_enabled({"RECFUSE_AUTOTUNE": "1"}), tuning_enabled({})
    (True, False)
"""
from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import tempfile
import threading
import time
from typing import Callable, Optional, Sequence, Union

import torch
import triton

from . import configs, tuning
from ..chain import chain_of
from ..reference import batched_feature_mlp, batched_ln_tanh_linear_relu
from .composite import composite_backward

log = logging.getLogger("recfuse")

AUTOTUNE_ENV = "RECFUSE_AUTOTUNE"
# Relative error in norm against float64 a candidate must stay under (the CLI tuner's bounds).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# |z| (z ~ N(0, 1) here) below this is a relu tie: grad_y is zeroed there (`_references`).
RELU_TIE = 1e-4
# Candidates beyond the heuristic's and the tables' configs (`tuning.spread`).
MAX_CANDIDATES = 12
FEATURES = 64
X_MB = 64.0
MASKED_FEATURES, MASKED_BATCH = 3, 1000
# The fastest FINALISTS are timed again at CONFIRM_SCALE times the batch and ranked by both sizes
# (`tuning.confirm_at_scale`): the CLI tuner's 16-programs-per-SM winners at x 256 MB collapsed
# at 1 GB on the H100 (benchmarks/NOTES.md, "the tuner's size was a trap").
CONFIRM_SCALE, FINALISTS = 4, 4
# ... with the LayerNorm affine per feature and without one (`_confirmed_at_scale`).
CONFIRM_AFFINE = ("per_feature", "none")
EPS = 1e-5

_LOCK = threading.Lock()
_LOCAL = threading.local()  # .busy: this thread is tuning (its own lookups never tune)
# (cache path, kind, D, H, dtype name, full_tiles) -> what became of it in this process:
# "tuning", "tuned", "cached", "shipped" or "failed: ...". Failures are kept so a shape that
# cannot be tuned is not tried again on every lookup.
_TRIED: dict = {}


def tuning_enabled(environ=os.environ) -> bool:
    """Whether ``RECFUSE_AUTOTUNE`` asks for tuning on first use ("1", "true", "yes", "on")."""
    return environ.get(AUTOTUNE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# The conditions under which a lookup never tunes, one predicate each (tests patch them).
def _on_cuda(device) -> bool:
    """A CUDA device index, real kernels (not the Triton interpreter)."""
    return (device != "cpu" and torch.cuda.is_available()
            and os.environ.get("TRITON_INTERPRET", "0") != "1")


def _capturing(device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _blocked(device) -> Optional[str]:
    """Why a lookup on ``device`` must not tune now, or None."""
    if os.environ.get(configs.TABLE_ENV, "").strip():
        return "RECFUSE_TUNED_TABLE is set"
    if getattr(_LOCAL, "busy", False):
        return "inside a tuning run"
    if configs.override_active():
        return "inside configs.override"
    if not _on_cuda(device):
        return "not a CUDA device (CPU or the Triton interpreter)"
    if _compiling():
        return "torch.compile is tracing"
    if _capturing(device):
        return "a CUDA graph is being captured"
    return None


def on_lookup(kind: str, D: int, H: int, dtype: torch.dtype, device: Union[str, int]) -> None:
    """`configs`' first-use hook: tune (kind, D, H, dtype) on ``device`` now if tuning is on, nothing
    blocks it (`_blocked`), and neither the cache nor this GPU model's shipped table has the
    shape. Called on lookups no override forces; returns at once when tuning is off."""
    if not tuning_enabled():
        return
    full = D == triton.next_power_of_2(D)  # the tuner's key: masked columns file under False
    key = configs.cache_key(kind, D, H, dtype, full)
    if _blocked(device) is not None:  # not remembered: a later lookup may tune
        return
    path = configs.cache_path(device)
    tried = (path,) + key
    if tried in _TRIED:
        return
    cached = configs.cached_entry(kind, D, H, dtype, device, full)
    if cached is not None and configs.config_from_entry(kind, cached, D, H, dtype, full) is not None:
        _TRIED[tried] = "cached"
        return  # (an entry this version's configs cannot read is tuned again and replaced)
    if key in configs.load_table(configs.device_slug(device)):
        # measured on this GPU model by the full sweep (benchmarks/tune_kernels.py): kept
        _TRIED[tried] = "shipped"
        return
    if kind == "backward" and configs.heuristic_backward(D, H, dtype) is None:
        return  # no kernel covers the shape
    with _LOCK:  # a second thread waits here, then finds the shape tried
        if tried in _TRIED:
            return
        _TRIED[tried] = "tuning"
        _LOCAL.busy = True
        try:
            fresh = configs.table_entries(configs.read_cache_file(path)).get(key)
            if fresh is not None and configs.config_from_entry(kind, fresh, D, H, dtype, full) is not None:
                # another process tuned it since this one read the cache
                configs.cache_written()
                _TRIED[tried] = "cached"
                return
            entry = tune_shape(kind, D, H, dtype, device)
            _TRIED[tried] = "tuned" if entry is not None else "failed: no candidate passed"
        except Exception as err:  # noqa: BLE001 - tuning must not break the caller's step
            _TRIED[tried] = f"failed: {type(err).__name__}: {err}"
            log.warning("recfuse autotune: %s D=%d H=%d %s failed (%s: %s); keeping the %s config", kind, D, H,
                        key[3], type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "",
                        "table's" if configs.table_slug(device) != "none" else "heuristic")
        finally:
            _LOCAL.busy = False


# ---------------------------------------------------------------------------------------------
# one shape


def synthetic_inputs(F: int, B: int, D: int, H: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """Synthetic inputs, torchrec layout, from a private generator (the global RNG is untouched)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device=device, generator=g) * scale + shift).to(dtype)

    x = rnd(B, F * D).view(B, F, D)
    return dict(x=x, w=rnd(H, D, scale=D ** -0.5), b=rnd(H, scale=0.1, shift=0.1),
                lw=rnd(F, D, scale=0.2, shift=1.0), lb=rnd(F, D, scale=0.2), gy=rnd(B, F, H))


def _references(t: dict, kind: str) -> list:
    """The float64 composite's outputs of ``kind``: [y] or the gradients. For the backward, grad_y
    is zeroed in place where the float64 z is within `RELU_TIE` of 0: there rounding decides the
    relu mask and one flipped element moves a gradient's norm by ~1/sqrt(B), rejecting correct
    configs (benchmarks/tune_kernels.py `references`)."""
    d = {k: v.double() for k, v in t.items()}
    if kind == "forward":
        return [batched_ln_tanh_linear_relu(d["x"], d["w"], d["b"], d["lw"], d["lb"], EPS, 1)]
    z = batched_feature_mlp(d["x"], d["w"], d["b"], d["lw"], d["lb"], EPS, 1, chain_of("layer_norm", "tanh", None))
    t["gy"].masked_fill_(z.abs() < RELU_TIE, 0)
    del z
    return list(composite_backward(t["gy"].double(), d["x"], d["w"], d["b"], d["lw"], d["lb"], EPS, 1))


def _rel_err(out: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    errs = [((a.double() - r).norm() / r.norm().clamp_min(1e-12)).item()
            for a, r in zip(out, ref) if a is not None and a.numel()]
    return max(errs) if errs else float("inf")


def _stats(t: dict, D: int, H: int, dtype: torch.dtype, full_tiles: bool, backward=None):
    """The forward's saved row stats (heuristic config), which the backward reads; with the relu
    mask where ``backward`` (else the backward config in use) reads it (`launch._relu_mask_words`)."""
    from . import launch  # imported on first use, as the op does: `import recfuse` stays light

    cfg = configs.heuristic_forward(D, H, dtype, full_tiles)
    with configs.override(forward=cfg, backward=backward):
        plan = launch.forward_plan(t["x"], t["w"], t["b"], t["lw"], t["lb"], EPS, 1, save_stats=True)
    return plan(t["x"], t["w"], t["b"], t["lw"], t["lb"])[1]


def candidate_stats(t: dict, cfg, stats):
    """The row stats a backward candidate runs on: the shape's ``stats``, or for a two-pass, a
    two-part tl.dot row or a GEMM-backward candidate those the forward saves for it (the relu mask
    at any D, `launch._relu_mask_words`; without it the GEMM backward's plan would be the fused
    kernels'). The CLI tuner times its candidates on these too."""
    if not (cfg.two_pass or cfg.gemm or (cfg.use_dot and cfg.row_parts)):
        return stats
    D, H = t["w"].shape[-1], t["w"].shape[-2]
    return _stats(t, D, H, t["x"].dtype, D == triton.next_power_of_2(D), backward=cfg)


def _call(kind: str, t: dict, cfg, stats, train: bool = False) -> Callable[[], list]:
    """A call of one candidate's kernel(s) on ``t``, returning [y] or the gradients; raises when the
    config does not make a plan (the composite would run the shape). ``train``: the forward as a
    training step launches it (saving the row stats, and the relu mask where the backward reads it)."""
    from . import launch

    if kind == "forward":
        with configs.override(forward=cfg):
            plan = launch.forward_plan(t["x"], t["w"], t["b"], t["lw"], t["lb"], EPS, 1, save_stats=train)
        return lambda: [plan(t["x"], t["w"], t["b"], t["lw"], t["lb"])[0]]
    stats = candidate_stats(t, cfg, stats)
    with configs.override(backward=cfg):
        plan = launch.backward_plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], EPS, 1, stats)
    if plan is None:
        raise ValueError("no backward kernel plan for this config")
    load = stats if plan.reads_stats else None
    return lambda: list(plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], load))


def candidates(kind: str, D: int, H: int, dtype: torch.dtype, device: Union[str, int, None] = None,
               limit: int = MAX_CANDIDATES) -> list:
    """The short list tuned for one shape: the heuristic's config, the shipped tables' config for
    ``device`` (if another), then `tuning.spread` of the generator's list; each as its table entry
    reproduces it (`configs.config_from_entry`), duplicates and entries that do not fit dropped.

    Example:
        >>> import torch
        >>> cands = candidates("backward", 256, 16, torch.bfloat16, "cpu", limit=4)
        >>> len(cands) <= 5, cands[0] == configs.heuristic_backward(256, 16, torch.bfloat16)
        (True, True)
    """
    full = D == triton.next_power_of_2(D)
    if kind == "forward":
        pool = tuning.forward_candidates(D, H, dtype)
        incumbent = configs.table_forward_config(D, H, dtype, device, full) if device is not None else None
    else:
        pool = tuning.backward_candidates(D, H, dtype)
        incumbent = configs.table_backward_config(D, H, dtype, device) if device is not None else None
    picked = tuning.spread(pool, limit)
    if incumbent is not None:
        picked.insert(1, incumbent)
    out = []
    for cfg in picked:
        cfg = configs.config_from_entry(kind, configs.config_to_entry(cfg), D, H, dtype, full)
        if cfg is not None and cfg not in out:
            out.append(cfg)
    return out


def _do_bench_us(fn: Callable) -> float:
    """Median time of ``fn`` in microseconds (``triton.testing.do_bench``: L2 flushed, CUDA events)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25, return_mode="median") * 1e3


def tune_shape(kind: str, D: int, H: int, dtype: torch.dtype, device: Union[str, int, torch.device], *,
               features: int = FEATURES, batch: Optional[int] = None, x_mb: float = X_MB,
               masked_features: int = MASKED_FEATURES, masked_batch: int = MASKED_BATCH,
               cands: Optional[list] = None, limit: int = MAX_CANDIDATES,
               bench: Optional[Callable[[Callable], float]] = None, write: bool = True,
               seed: int = 0, confirm_scale: int = CONFIRM_SCALE, finalists: int = FINALISTS) -> Optional[dict]:
    """Tune one (kind, D, H, dtype) on ``device`` and (``write``) merge the winner into its cache
    file; returns the winner's table entry, or None when no candidate passed the checks.

    ``device``: a CUDA index / device, or "cpu" (the Triton interpreter; sizes tiny). ``batch``
    (default: x about ``x_mb`` MB over ``features`` features, a multiple of 64), ``cands`` (default
    `candidates`), ``bench`` (``fn -> microseconds``; default ``triton.testing.do_bench``'s median)
    are for tests and tools; the automatic trigger (`on_lookup`) takes the defaults. The fastest
    ``finalists`` are timed again at ``confirm_scale`` times the batch (1: off), with and without
    the LayerNorm affine, and the winner is the one best at both sizes (`tuning.confirm_at_scale`).
    """
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    lookup_device = "cpu" if dev.type == "cpu" else (dev.index if dev.index is not None else torch.cuda.current_device())
    full = D == triton.next_power_of_2(D)
    key = configs.cache_key(kind, D, H, dtype, full)
    if cands is None:
        cands = candidates(kind, D, H, dtype, lookup_device, limit)
    if not cands:
        return None
    bench = bench or _do_bench_us
    F = features
    B = batch or max(64, int(x_mb * 2 ** 20 / (F * D * dtype.itemsize)) // 64 * 64)
    log.info("recfuse autotune: tuning %s D=%d H=%d %s on %s: %d candidates, F=%d B=%d ...", kind, D, H, key[3],
             configs.device_slug(lookup_device), len(cands), F, B)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if dev.type == "cuda":
            stack.enter_context(torch.cuda.device(dev))
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast(dev.type, enabled=False))
        try:
            rows, copy_gbps = _measure(kind, cands, F, B, D, H, dtype, dev, full, bench, seed)
            ranked = sorted((r for r in rows if "us" in r), key=tuning.rank_us)
            if confirm_scale > 1 and len(ranked) > 1:
                ranked = _confirmed_at_scale(kind, ranked, F, B * confirm_scale, D, H, dtype, dev, full, bench,
                                             seed, finalists)
            winner = _first_right_at_masked_rows(kind, ranked, masked_features, masked_batch, D, H, dtype, dev,
                                                 seed)
        finally:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    rejected = [r for r in rows if "rejected" in r]
    if rejected:
        log.info("recfuse autotune: %s D=%d H=%d %s: %d of %d candidates rejected: %s", kind, D, H, key[3],
                 len(rejected), len(rows), "; ".join(sorted({r["rejected"] for r in rejected})[:3]))
    if winner is None:
        log.warning("recfuse autotune: %s D=%d H=%d %s: no candidate passed (%.1f s)", kind, D, H, key[3], seconds)
        return None
    itemsize = dtype.itemsize
    x_bytes, y_bytes = B * F * D * itemsize, B * F * H * itemsize
    floor_us = (x_bytes + y_bytes if kind == "forward" else 2 * x_bytes + y_bytes) / copy_gbps / 1e3
    heuristic_us = rows[0].get("us")
    entry = dict(D=D, H=H, dtype=key[3], full_tiles=key[4], config=configs.config_to_entry(winner["cfg"]),
                 us=winner["us"], pct_floor=100 * floor_us / winner["us"],
                 **({"train_us": winner["train_us"]} if "train_us" in winner else {}),
                 **({"confirm_us": winner["confirm_us"], "confirm_scale": confirm_scale}
                    if "confirm_us" in winner else {}),
                 heuristic_us=heuristic_us,
                 candidates=len(rows), rejected=len(rejected), source="autotune", seconds=round(seconds, 1))
    log.info("recfuse autotune: %s D=%d H=%d %s: %.1f us, heuristic %s (%s), %.1f s", kind, D, H, key[3],
             winner["us"], f"{heuristic_us:.1f} us" if heuristic_us else "rejected",
             f"{heuristic_us / winner['us']:.2f}x" if heuristic_us else "-", seconds)
    if write:
        path = configs.cache_path(lookup_device)
        write_entry(path, kind, entry, _table_meta(dev, F, x_mb if batch is None else B * F * D * itemsize / 2 ** 20))
        log.info("recfuse autotune: wrote %s", path)
    return entry


def _measure(kind, cands, F, B, D, H, dtype, dev, full, bench, seed):
    """Each candidate checked against float64 and timed: rows with "cfg" and "us" or "rejected",
    in candidate order; and the copy bandwidth (GB/s) of x on the device (the floor's unit)."""
    t = synthetic_inputs(F, B, D, H, dtype, dev, seed)
    try:
        ref = _references(t, kind)
        stats = _stats(t, D, H, dtype, full) if kind == "backward" else None
        dst = torch.empty_like(t["x"])
        copy_gbps = 2 * t["x"].numel() * dtype.itemsize / bench(lambda: dst.copy_(t["x"])) / 1e3
        del dst
        rows = []
        for cfg in cands:
            row = {"cfg": cfg}
            try:
                fn = _call(kind, t, cfg, stats)
                # a forward config serves a training step's forward too (`tuning.rank_us`)
                train_fn = _call(kind, t, cfg, stats, train=True) if kind == "forward" else None
                err = _rel_err(fn(), ref)
                if train_fn is not None:
                    err = max(err, _rel_err(train_fn(), ref))
                row["err"] = err
                if not err <= TOLERANCE[dtype]:
                    row["rejected"] = f"relative error {err:.1e}"
                else:
                    row["us"] = bench(fn)
                    if train_fn is not None:
                        row["train_us"] = bench(train_fn)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is dropped
                row["rejected"] = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
            log.debug("recfuse autotune: %s %s", configs.config_to_entry(cfg), row.get("us", row.get("rejected")))
            rows.append(row)
        return rows, copy_gbps
    finally:
        del t


def per_affine_mode(t: dict, modes=CONFIRM_AFFINE) -> list:
    """``t`` (`synthetic_inputs`) as each LayerNorm affine mode calls the op: "per_feature" the
    inputs themselves, "none" without ``lw`` and ``lb``. Both tuners confirm their finalists on these.

    Example:
        >>> t = synthetic_inputs(2, 4, 8, 1, torch.float32, "cpu")
        >>> [tm["lw"] is None for tm in per_affine_mode(t)]
        [False, True]
    """
    return [t if mode == "per_feature" else dict(t, lw=None, lb=None) for mode in modes]


def _confirmed_at_scale(kind, ranked, F, B, D, H, dtype, dev, full, bench, seed, finalists,
                        affine_modes=CONFIRM_AFFINE) -> list:
    """``ranked`` (timed rows, fastest first) re-ranked by `tuning.confirm_at_scale` with the
    finalists timed at F x B rows, with the per-feature LayerNorm affine and (``affine_modes``)
    without one, the times summed: an entry serves both calls, and one mode's winner has lost the
    other's by 5-10% (benchmarks/NOTES.md, twentieth session). A finalist that fails there counts
    as infinitely slow."""
    t = synthetic_inputs(F, B, D, H, dtype, dev, seed + 2)
    try:
        inputs = per_affine_mode(t, affine_modes)
        stats = [_stats(tm, D, H, dtype, full) if kind == "backward" else None for tm in inputs]

        def time_at_scale(row):
            total = 0.0
            try:
                for tm, st in zip(inputs, stats):
                    total += bench(_call(kind, tm, row["cfg"], st))
                    if kind == "forward":
                        total += bench(_call(kind, tm, row["cfg"], st, train=True))
            except Exception:  # noqa: BLE001 - out of memory or not compiling at this size
                return float("inf")
            return total

        return tuning.confirm_at_scale(ranked, time_at_scale, finalists)
    finally:
        del t


def _first_right_at_masked_rows(kind, timed, F, B, D, H, dtype, dev, seed) -> Optional[dict]:
    """The first of ``timed`` (rows in the order they rank) whose config is also right at F x B rows
    (B not a multiple of its tiles: masked tiles compile to other code; a 32-row bf16 tile once
    was right at full tiles and 3.0 off float64 at B = 1000 on the H100). Rows failing it are
    marked rejected."""
    if not timed:
        return None
    t = synthetic_inputs(F, B, D, H, dtype, dev, seed + 1)
    try:
        ref = _references(t, kind)
        stats = _stats(t, D, H, dtype, False) if kind == "backward" else None
        for row in timed:
            try:
                ok = _rel_err(_call(kind, t, row["cfg"], stats)(), ref) <= TOLERANCE[dtype]
            except Exception:  # noqa: BLE001
                ok = False
            if ok:
                return row
            row["rejected"] = f"wrong with masked rows (B={B})"
            del row["us"]
        return None
    finally:
        del t


# ---------------------------------------------------------------------------------------------
# the cache file


def _table_meta(dev: torch.device, F: int, x_mb: float) -> dict:
    """The top-level fields of a table file (as benchmarks/tune_kernels.py writes them)."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        gpu, sms, cc = props.name, props.multi_processor_count, [props.major, props.minor]
    else:
        gpu, sms, cc = "cpu (Triton interpreter)", 0, [0, 0]
    return {"gpu": gpu, "sm_count": sms, "compute_capability": cc, "torch": torch.__version__,
            "triton": triton.__version__, "date": datetime.date.today().isoformat(),
            "setup": f"tuned on first use (recfuse.ops.autotune): BFD layout, F={F}, x ~{x_mb:g} MB, "
                     f"shared weight + bias, per-feature LN affine"}


@contextlib.contextmanager
def _file_lock(path: str):
    """An exclusive lock on ``path`` across processes (POSIX; elsewhere none: os.replace keeps
    the file whole, and a lost concurrent entry is tuned again by a later process)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_entry(path: str, kind: str, entry: dict, meta: dict) -> None:
    """Merge one entry into a cache file, atomically: what the file holds now (re-read under a
    file lock: another process may have written it) with this entry replacing its shape's, to a
    temporary file in the same folder, then ``os.replace``; this process's lookups re-read it."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with _file_lock(path + ".lock"):
        table = configs.read_cache_file(path)
        table.update(meta)
        shape = (entry["D"], entry["H"], entry["dtype"], entry.get("full_tiles", True))
        for k in ("forward", "backward"):
            rows = [e for e in table.get(k, [])
                    if k != kind or (e["D"], e["H"], e["dtype"], e.get("full_tiles", True)) != shape]
            if k == kind:
                rows.append(entry)
            table[k] = sorted(rows, key=lambda e: (e["dtype"], e["D"], e["H"], e.get("full_tiles", True)))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(table, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    configs.cache_written()


configs.set_first_use_hook(on_lookup)
