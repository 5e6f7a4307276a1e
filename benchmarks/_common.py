"""What the benchmark tools share: timing, inputs, floors and environment capture.

Every tool in benchmarks/ imports this module as ``_common`` (a script's own folder is first on
``sys.path``); nothing outside benchmarks/ imports it, and it imports nothing from tests/.

* timing: ``do_bench_us`` (triton's do_bench median, CUDA events with L2 flushed; plain CUDA
  events without triton), ``perf_counter_us`` (a perf_counter median, the CPU stand-in),
  ``make_bench`` (the one of them that fits the device), ``wall_us`` (median of single calls,
  each followed by a synchronisation: launch overhead included, as the puzzler measures),
  ``loop_us`` (calls issued back to back, one synchronisation: the rate a host can issue them),
  ``kernels_per_call`` and ``extra_peak_bytes``;
* inputs: ``Shape`` (F, B, D, H), ``op_inputs`` (x in the [B, F*D] buffer layout or as [F, B, D], the op's parameters and
  an output gradient), ``PerSlice`` (the per-feature model that ``recfuse.transform`` rewrites),
  ``relative_error``, ``TOLERANCE``;
* floors: ``copy_bandwidth`` (a device-to-device copy timed in the same run) and ``floor_us``
  (the bytes a perfect kernel moves over that bandwidth), ``forward_bytes`` / ``training_bytes``;
* environment: ``environment`` (device and its name, torch / triton / recfuse / python
  versions, date), ``gpu_slug`` (the file-name tag of a device: ``h100``, ``h200``, ``cpu``),
  ``json_safe``.

Example:
    >>> import torch
    >>> bench = make_bench("cpu", warmup_ms=1, rep_ms=5)
    >>> inp = op_inputs(4, 8, 16, 2, torch.float32, "cpu", seed=0)
    >>> tuple(inp.x.shape), inp.feature_dim, tuple(inp.grad_y.shape)
    ((8, 4, 16), 1, (8, 4, 2))
    >>> bench(lambda: inp.x.sum()) > 0
    True
    >>> copy = copy_bandwidth(1 << 16, "cpu", bench)
    >>> floor_us(forward_bytes(inp.x, inp.grad_y), copy["GBps"]) > 0
    True
    >>> gpu_slug("NVIDIA H100 80GB HBM3"), gpu_slug("NVIDIA H200"), device_slug("cpu")
    ('h100', 'h200', 'cpu')
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"

# The grid of the targets (DESIGN.md), which the tuned tables cover, and shapes off it that users
# have too: D with no 16-column chunk (24, 40: masked narrow rows) or not a power of two (96, 100,
# 192, 384), H between the tuned ones. The twenty-third session found these 1.4-4.8x slower than
# they needed to be (results/checks/offgrid_h200.txt).
GRID_DIMS = (32, 48, 64, 128, 160, 256, 512)
GRID_HS = (1, 4, 16, 64)
OFF_GRID_DIMS = (24, 40, 96, 100, 192, 384)
OFF_GRID_HS = (2, 8, 32)

# ||out - ref|| / ||ref|| bounds against float64, the same as DESIGN.md and the op tests.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}


# ----------------------------------------------------------------------------------------- timing
def sync(device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def do_bench_us(fn: Callable, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median GPU time of `fn` in microseconds: triton's do_bench (CUDA events, L2 flushed between
    calls), or plain CUDA events where triton is missing."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return cuda_events_us(fn)
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def cuda_events_us(fn: Callable, repeats: int = 50) -> float:
    """Median of `repeats` calls of `fn`, each between two CUDA events (no L2 flush)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3


def perf_counter_us(fn: Callable, warmup_ms: float = 10, rep_ms: float = 40, min_calls: int = 3) -> float:
    """Median wall time of `fn` in microseconds over `rep_ms` of calls after `warmup_ms` of them
    (the CPU stand-in for do_bench)."""
    t_end = time.perf_counter() + warmup_ms / 1e3
    fn()
    while time.perf_counter() < t_end:
        fn()
    times = []
    t_end = time.perf_counter() + rep_ms / 1e3
    while len(times) < min_calls or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def make_bench(device, warmup_ms: float = 25, rep_ms: float = 100) -> Callable[[Callable], float]:
    """fn -> median microseconds per call: `do_bench_us` on CUDA, `perf_counter_us` on the CPU."""
    if torch.device(device).type == "cuda":
        return lambda fn: do_bench_us(fn, warmup_ms, rep_ms)
    return lambda fn: perf_counter_us(fn, warmup_ms, rep_ms)


def wall_us(fn: Callable, device="cuda", repeats: int = 200, warmup: int = 20) -> float:
    """Median microseconds of single calls, each timed from launch to host synchronisation."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def loop_us(fn: Callable, calls: int, device="cuda", warmup: int = 50, repeats: int = 5) -> float:
    """Best of `repeats` means of `calls` calls of `fn` issued back to back, with one
    synchronisation at the end of each loop: the host's cost per call once launches queue up."""
    for _ in range(warmup):
        fn()
    sync(device)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def add_shape_args(ap, F: int, B: int, D: int, H: int) -> None:
    """The --F --B --D --H options of a tool that runs one shape (features, batch, width, outputs)."""
    for name, default in (("F", F), ("B", B), ("D", D), ("H", H)):
        ap.add_argument(f"--{name}", type=int, default=default)


def host_us_per_call(fn: Callable, n: int) -> float:
    """Mean wall time of `n` calls of `fn` in microseconds, no synchronisation: host cost alone
    (CPU tensors, or stubbed launches)."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def profile_calls(fn: Callable, n: int = 10):
    """`pstats.Stats` of `n` calls of `fn` under cProfile (after one call outside it)."""
    import cProfile
    import pstats

    fn()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    return pstats.Stats(pr)


def python_calls_per_call(fn: Callable, n: int = 10) -> float:
    """Python function calls per call of `fn` (cProfile over `n` calls, after one untimed)."""
    return profile_calls(fn, n).total_calls / n


def no_grad_call(fn: Callable) -> Callable:
    """`fn` called under torch.no_grad (an inference call, for the timers).

    Example:
        >>> no_grad_call(lambda: torch.ones(1, requires_grad=True) * 2)().requires_grad
        False
    """
    def call():
        with torch.no_grad():
            return fn()
    return call


def training_step_call(fn: Callable, params) -> Callable:
    """One training step of `fn`: every parameter's .grad set to None, then `fn().sum().backward()`.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> training_step_call(lambda: w * 3, [w])(); w.grad.tolist()
        [3.0, 3.0]
    """
    def call():
        for p in params:
            p.grad = None
        fn().sum().backward()
    return call


@contextlib.contextmanager
def quiet_c_output():
    """Send the process's C-level stdout and stderr (file descriptors 1 and 2) to a temp file
    (the CPU profiler prints "USDT ... profiler_stop" lines from C code)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def kernels_per_call(fn: Callable, device="cuda", calls: int = 1):
    """What one call of `fn` dispatches, from torch.profiler over `calls` calls after one
    unprofiled call: on CUDA every device kernel, memcpy and memset; on the CPU the top-level
    aten/recfuse ops (the C++ loops Inductor generates are not ops). An int when whole."""
    return device_activity(fn, device, calls)[0]


def device_activity(fn: Callable, device="cuda", calls: int = 1) -> tuple:
    """(`kernels_per_call`, device busy time per call in us: the sum of the CUDA kernel, memcpy and
    memset durations, None on the CPU). Busy time below a call's wall time means the host, not
    the GPU, sets the rate."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    fn()
    sync(device)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with quiet_c_output(), profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    busy_us = None
    if cuda:
        device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        count = len(device_events)
        busy_us = sum(e.time_range.elapsed_us() for e in device_events) / calls
    else:
        count = sum(1 for e in prof.events() if _is_top_level_op(e))
    whole, rest = divmod(count, calls)
    return (whole if rest == 0 else count / calls), busy_us


def kernel_times(fn: Callable, device="cuda", calls: int = 1) -> dict:
    """{kernel name: GPU time per call in us} of `fn`'s CUDA kernels (memcpy and memset included),
    largest first: where a call's device time goes. Empty on the CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if torch.device(device).type != "cuda":
        return {}
    fn()
    sync(device)
    with quiet_c_output(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    times: dict = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us() / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def _is_op(name: str) -> bool:
    return name.startswith("aten::") or name.startswith("recfuse::")


def _is_top_level_op(event) -> bool:
    """An aten/recfuse op not called from inside another one (what a user's code dispatched)."""
    if not _is_op(event.name):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent.name):
            return False
        parent = parent.cpu_parent
    return True


def extra_peak_bytes(fn: Callable, device="cuda") -> Optional[int]:
    """Peak memory one call of `fn` allocates above what was allocated before it (CUDA; None on
    the CPU). The call's result is dropped after the measurement."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return torch.cuda.max_memory_allocated() - before


# ------------------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class Shape:
    """F features of width D over a batch of B rows, Linear(D, H): the sizes every tool varies.

    Example:
        >>> Shape(16, 1024, 256, 1).numel_x()
        4194304
    """

    F: int
    B: int
    D: int
    H: int

    def numel_x(self) -> int:
        return self.F * self.B * self.D

    def numel_y(self) -> int:
        return self.F * self.B * self.H


@dataclass
class OpInputs:
    """Arguments of one `recfuse.ln_tanh_linear_relu` call and an output gradient."""

    buf: torch.Tensor              # the allocation x views: [B, F*D] ("BFD") or [F, B, D] ("FBD")
    x: torch.Tensor                # what the op reads: [B, F, D] view or [F, B, D]
    feature_dim: int               # 1 for "BFD", 0 for "FBD"
    weight: torch.Tensor           # [H, D], or [F, H, D] with weight="per_feature"
    bias: Optional[torch.Tensor]   # None, [H] or [F, H]
    ln_weight: Optional[torch.Tensor]
    ln_bias: Optional[torch.Tensor]
    grad_y: torch.Tensor           # x's layout with D replaced by H

    def params(self) -> list[torch.Tensor]:
        """weight, bias, ln_weight, ln_bias: those present."""
        return [t for t in (self.weight, self.bias, self.ln_weight, self.ln_bias) if t is not None]


def op_inputs(F_: int, B: int, D: int, H: int, dtype=torch.float32, device="cpu", *, layout: str = "BFD",
              weight: str = "shared", bias: str = "shared", ln: str = "per_feature", seed: int = 0,
              bias_mean: float = 0.0, ln_scale: float = 0.1) -> OpInputs:
    """Random inputs of the op, drawn in float32 on `device` from `seed`, then cast to `dtype`.

    layout "BFD": a [B, F*D] buffer (torchrec's KeyedTensor) viewed as [B, F, D], feature_dim=1;
    "FBD": a contiguous [F, B, D] tensor, feature_dim=0. weight "shared" [H, D] or "per_feature"
    [F, H, D], scaled by D**-0.5; bias "none" / "shared" [H] / "per_feature" [F, H], values
    bias_mean + 0.1 * randn; ln (LayerNorm affine) "none" / "shared" [D] / "per_feature" [F, D],
    weight 1 + ln_scale * randn, bias ln_scale * randn.

    Example:
        >>> inp = op_inputs(3, 5, 8, 2, layout="FBD", weight="per_feature", ln="none")
        >>> tuple(inp.x.shape), tuple(inp.weight.shape), inp.ln_weight is None
        ((3, 5, 8), (3, 2, 8), True)
    """
    if layout not in ("BFD", "FBD"):
        raise ValueError(f"layout must be 'BFD' or 'FBD', got {layout!r}")
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device=device, generator=g) * scale + shift).to(dtype)

    per_feature = {"none": None, "shared": (), "per_feature": (F_,)}
    if layout == "BFD":
        buf = rnd(B, F_ * D)
        x, feature_dim, y_shape = buf.view(B, F_, D), 1, (B, F_, H)
    else:
        buf = rnd(F_, B, D)
        x, feature_dim, y_shape = buf, 0, (F_, B, H)
    w = rnd(*per_feature[weight], H, D, scale=D ** -0.5)
    b = None if per_feature[bias] is None else rnd(*per_feature[bias], H, scale=0.1, shift=bias_mean)
    if per_feature[ln] is None:
        lw = lb = None
    else:
        lw = rnd(*per_feature[ln], D, scale=ln_scale, shift=1.0)
        lb = rnd(*per_feature[ln], D, scale=ln_scale)
    return OpInputs(buf, x, feature_dim, w, b, lw, lb, rnd(*y_shape))


class PerSlice(nn.Module):
    """F features of width D, each with its own LayerNorm, then a shared Linear and relu: the
    per-feature form that `recfuse.transform` rewrites. Takes a [B, F*D] tensor.

    Example:
        >>> PerSlice(3, 4, 2)(torch.randn(5, 12)).shape
        torch.Size([5, 3, 2])
    """

    def __init__(self, features: int, dim: int, out: int):
        super().__init__()
        self.dim = dim
        self.lns = nn.ModuleList([nn.LayerNorm(dim) for _ in range(features)])
        self.linear = nn.Linear(dim, out)

    def forward(self, x):
        slices = torch.split(x, self.dim, dim=1)
        outs = [torch.tanh(ln(s)) for ln, s in zip(self.lns, slices)]
        return F.relu(self.linear(torch.stack(outs, dim=1)))


def relative_error(out: Optional[torch.Tensor], ref: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor) in float64; inf for a missing output or for NaN where
    the reference has none (NaN where it has NaN too, eps=0 on a constant row, is correct).

    Example:
        >>> relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]).double())
        0.0
    """
    if out is None:
        return math.inf
    out = out.detach().double().reshape(ref.shape)
    ref = ref.detach().double()
    ref_nan = torch.isnan(ref)
    if torch.isnan(out).ne(ref_nan).any():
        return math.inf
    if ref_nan.any():
        out, ref = out[~ref_nan], ref[~ref_nan]
    diff = (out - ref).norm().item()
    scale = max(ref.norm().item(), floor)
    return diff / scale if scale > 0 else diff


# ------------------------------------------------------------------------------------------ floors
def copy_bandwidth(nbytes: int, device, bench: Optional[Callable[[Callable], float]] = None) -> dict:
    """Time a device-to-device copy of `nbytes`: {"bytes", "time_us", "GBps"} (GB/s counting the
    read and the write). Timed with `bench` (default: `make_bench(device)`)."""
    src = torch.ones(max(1, nbytes), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    bench = bench or make_bench(device)
    for _ in range(3):
        dst.copy_(src)
    us = bench(lambda: dst.copy_(src))
    del src, dst
    return {"bytes": max(1, nbytes), "time_us": us, "GBps": 2 * max(1, nbytes) / (us * 1e-6) / 1e9}


def nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def forward_bytes(x: torch.Tensor, y: torch.Tensor) -> int:
    """What a perfect forward moves: it reads x and writes y (y: the output or its gradient)."""
    return nbytes(x) + nbytes(y)


def training_bytes(x: torch.Tensor, y: torch.Tensor) -> int:
    """What a perfect training step moves (DESIGN.md): the forward reads x and writes y, the
    backward reads x and grad_y and writes dx: 3 x + 2 y."""
    return 3 * nbytes(x) + 2 * nbytes(y)


def floor_us(bytes_moved: int, copy_GBps: float) -> float:
    """Microseconds `bytes_moved` take at the measured copy bandwidth."""
    return bytes_moved / (copy_GBps * 1e9) * 1e6


# ------------------------------------------------------------------------------------- environment
def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (else platform's guess)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device) -> str:
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def gpu_slug(name: str) -> str:
    """The tag of a device in result file names: 'NVIDIA H100 80GB HBM3' -> 'h100',
    'NVIDIA H200' -> 'h200'; otherwise a slug of the name."""
    m = re.search(r"\b([A-Za-z]{1,2}\d{2,4}[A-Za-z]?)\b", name.replace("NVIDIA", ""))
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def device_slug(device) -> str:
    """gpu_slug of a CUDA device's name; 'cpu' for the CPU."""
    device = torch.device(device)
    return gpu_slug(torch.cuda.get_device_name(device)) if device.type == "cuda" else "cpu"


def triton_version() -> Optional[str]:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def environment(device) -> dict:
    """Where a run ran: device, device_name, torch, triton, recfuse, python, platform,
    cpu_threads, date (UTC, ISO 8601), and cuda on a GPU."""
    import recfuse

    device = torch.device(device)
    env = {"device": str(device), "device_name": device_name(device), "torch": torch.__version__,
           "triton": triton_version(), "recfuse": recfuse.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpu_threads": torch.get_num_threads(), "date": utc_now()}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def command_line(argv=None) -> str:
    """The script's name and its arguments (`argv`, default sys.argv[1:]), as typed."""
    return " ".join([Path(sys.argv[0]).name, *(sys.argv[1:] if argv is None else argv)])


def json_safe(value):
    """Strict JSON: infinite or NaN floats are written as strings ("inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
