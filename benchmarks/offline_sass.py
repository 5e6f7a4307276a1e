"""Compile a launch plan's kernel for a GPU without one, and count what it became.

Triton's frontend, ptxas and cuobjdump run on any machine: this builds the forward or backward
launch plan of one (D, H, dtype) the way a CUDA call would (its config from a tuned table, the
heuristic, or knobs given on the command line; the CUDA values of the device-dependent constexprs;
the JIT's specialisations: integer arguments equal to 1 as constants, 16-divisible pointers and
integers), compiles it for sm_90 (or ``--arch``) and prints the registers, the stack (spills), the
shared memory, and the SASS instructions per element of a row tile by opcode.

Why: an instruction-bound kernel (benchmarks/NOTES.md, "an issue-rate ceiling") is judged by its
instructions an element, and a kernel change that does not compile for the GPU is caught here
instead of in device time (the K-chunked backward's loop edit once failed only on the H100).
The counts cover the whole kernel (prologue and epilogue too): upper bounds for the row loop.

Examples:
    $ python benchmarks/offline_sass.py --kind forward --D 256 --H 1 --dtype fp32
    $ python benchmarks/offline_sass.py --kind backward --D 256 --H 4 --dtype fp32 \\
          --knobs '{"use_dot": false, "unroll_h": 1, "block_b": 8, "num_warps": 2, "loop_stages": 3, "col_sums": 1}'
    $ python benchmarks/offline_sass.py --kind forward --D 256 --H 1 --dtype fp32 --tanh-mode 0  # the portable tanh
"""
from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from recfuse.ops import configs, gemm_backward, launch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def build_plan(kind: str, D: int, H: int, dtype: torch.dtype, *, table: str = "none", knobs: dict = None,
               F: int = 8, B: int = 4096, affine: bool = True):
    """(plan, config, its source, kernel arguments) of one call in the torchrec layout with a shared
    weight, bias and (`affine`) per-feature LayerNorm affine, made on CPU tensors with a CUDA call's
    constexprs. A tl.dot backward reads the relu mask where a CUDA training forward saves one."""
    full = D == triton.next_power_of_2(D)
    if knobs:
        cfg = (configs.heuristic_forward(D, H, dtype, full, **knobs) if kind == "forward"
               else configs.heuristic_backward(D, H, dtype, **knobs))
        source = "knobs"
    else:  # the lookup a CUDA call makes, in the named table (its nearest entry, else the heuristic)
        cfg = (configs.table_forward_config(D, H, dtype, "cpu", full, table=table) if kind == "forward"
               else configs.table_backward_config(D, H, dtype, "cpu", table=table))
        source = f"table {table}"
    if cfg is None:
        raise SystemExit(f"no {kind} kernel covers D={D} H={H} {dtype}")
    x = torch.randn(B, F * D).to(dtype).view(B, F, D)
    w, b = torch.randn(H, D).to(dtype), torch.randn(H).to(dtype)
    lw, lb = (torch.randn(F, D).to(dtype), torch.randn(F, D).to(dtype)) if affine else (None, None)
    # the planes a CUDA training forward saves: mean, rstd and (`launch._relu_mask_words`) the mask's words
    min_d = configs.relu_mask_min_d(dtype)
    words = (max(1, configs.dot_block_h(H) // 32)  # as `launch._relu_mask_words` counts them
             if kind == "backward" and cfg.use_dot and min_d is not None and H <= 64
             and (D >= min_d or cfg.two_pass or (cfg.row_parts and configs.row_parts_dot_fits(D)))
             else 0)
    stats = torch.randn(2 + words, F, B)
    if kind == "forward":
        with configs.override(forward=cfg):
            plan = launch.forward_plan(x, w, b, lw, lb, 1e-5, 1, save_stats=True)
        y = torch.empty(plan.y_shape, dtype=dtype)
        tensors = (x, w, b, lw, lb, y, stats)
        plan.meta.update(launch.device_constexprs("forward", dtype, "cuda"))
    else:
        gy = torch.randn(B, F, H).to(dtype)
        with configs.override(backward=cfg):
            plan = launch.backward_plan(gy, x, w, b, lw, lb, 1e-5, 1, stats)
        if plan is None:
            raise SystemExit(f"no backward kernel for D={D} H={H} {dtype} with {cfg}")
        if isinstance(plan, gemm_backward.GemmBackwardPlan):
            # its row kernel (`gemm_backward_kernels.norm_act_backward_rows`; the GEMM kernels are
            # plain tl.dot tiles): x, dt, dx, stats, affine, partials, f0
            plan.meta["FAST_TANH"] = launch.device_constexprs("backward", dtype, "cuda")["FAST_TANH"]
            dt, partial = torch.empty(F, B, D, dtype=dtype), torch.empty(2, plan.programs, F, D)
            return plan, cfg, source, (x, dt, x, stats, lw, lb, partial, 0) + tuple(plan.ints)
        dz = torch.empty(F, B, H, dtype=plan.dz_dtype or torch.float32)
        tensors = (gy, x, w, b, lw, lb, x, stats, stats, dz)
        cuda_constexprs = launch.device_constexprs("backward", dtype, "cuda", fp32_dots=cfg.fp32_dots)
        plan.meta.update(cuda_constexprs)
        if plan.weight_meta is not None:
            plan.weight_meta.update({k: v for k, v in cuda_constexprs.items() if k in plan.weight_meta})
    return plan, cfg, source, tensors + tuple(plan.ints)


def weight_kernel_args(plan, kernel_args: tuple) -> tuple:
    """The split backward's weight-gradient kernel arguments (x, dz, stats, ln affine, partial),
    from the fused kernel's."""
    gy, x, w, b, lw, lb, dx, partial, stats, dz = kernel_args[:10]
    return (x, dz, stats, lw, lb, partial, w) + tuple(plan.weight_ints)


def compile_offline(jit_fn, args: tuple, meta: dict, num_warps: int, num_stages: int, arch: int = 90,
                    maxnreg: int = 0):
    """``triton.compile`` of ``jit_fn`` for a CUDA target of compute capability ``arch``, with the
    argument types, the JIT's specialisations and the constexprs a launch with ``args`` and ``meta``
    has (and its register cap ``maxnreg``, 0: none)."""
    names = jit_fn.arg_names
    nospec = set(getattr(jit_fn, "do_not_specialize", None) or [])
    signature, constants, attrs = {}, {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        if isinstance(a, torch.Tensor):
            signature[name] = _TYPES[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a is None:  # an absent parameter: a None constexpr, as the JIT passes it
            signature[name], constants[(i,)] = "constexpr", None
        elif isinstance(a, float):
            signature[name] = "fp32"
        elif isinstance(a, bool):
            signature[name] = "i1"
        elif a == 1 and name not in nospec and i not in nospec:
            signature[name], constants[(i,)] = "constexpr", 1
        else:
            signature[name] = "i32" if abs(a) < 2 ** 31 else "i64"
            if a % 16 == 0 and name not in nospec and i not in nospec:
                attrs[(i,)] = [["tt.divisibility", 16]]
    defaults = {k: p.default for k, p in inspect.signature(jit_fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    for name in names[len(args):]:
        signature[name], constants[(names.index(name),)] = "constexpr", meta.get(name, defaults.get(name))
    return triton.compile(ASTSource(jit_fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages,
                                       **({"maxnreg": maxnreg} if maxnreg else {})))


def cuobjdump(kernel, *flags: str) -> str:
    """cuobjdump (the one Triton ships) of a compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(f.name)


_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*)")


def loops(sass: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(first, last) line indices of every loop in a kernel's SASS ((address, opcode, operands)
    lines): from the target of a branch back to an earlier address, to that branch.

    Example:
        >>> loops([(0, "MOV", ""), (16, "FADD", ""), (32, "BRA", " 0x10"), (48, "EXIT", "")])
        [(1, 2)]
    """
    index = {addr: i for i, (addr, _, _) in enumerate(sass)}
    found = []
    for i, (addr, op, operands) in enumerate(sass):
        target = re.search(r"0x([0-9a-f]+)", operands) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in index:
            found.append((index[int(target.group(1), 16)], i))
    return found


def executed_per_tile(sass: list, row_loop: bool, chunk_trips: int) -> int:
    """Instructions one row tile executes: with ``row_loop`` (a kernel that walks its row tiles in a
    loop) the longest loop's body, the prologue and epilogue paid once a program and left out;
    else the whole kernel. Loops inside that region are column-chunk loops: their bodies count
    ``chunk_trips`` times.

    Example:
        >>> code = [(0, "MOV", ""), (16, "FADD", ""), (32, "BRA", " 0x10"), (48, "EXIT", "")]
        >>> executed_per_tile(code, False, 4), executed_per_tile(code, True, 1)
        (10, 2)
    """
    found = loops(sass)
    first, last = 0, len(sass) - 1
    if row_loop and found:
        first, last = max(found, key=lambda fl: fl[1] - fl[0])
    count = last - first + 1
    for a, b in found:
        if first <= a and b <= last and (a, b) != (first, last):
            count += (b - a + 1) * (chunk_trips - 1)
    return count


def sass_report(kernel, elements_per_thread: float, row_loop: bool = False, chunk_trips: int = 1) -> dict:
    """Registers, stack bytes, shared memory, and SASS instructions (total, per element of one row
    tile per thread, by opcode) of a compiled kernel, and those one row tile executes an element
    (`executed_per_tile`: a row loop's body once its prologue is paid, chunk loops counted as
    many times as they run)."""
    usage = cuobjdump(kernel, "-res-usage")
    sass = [(int(m.group(1), 16), m.group(2), m.group(3))
            for m in map(_SASS_LINE.match, cuobjdump(kernel, "-sass").splitlines()) if m]
    ops = collections.Counter(op for _, op, _ in sass)
    executed = executed_per_tile(sass, row_loop, chunk_trips)
    total = sum(ops.values())
    return dict(registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                stack_bytes=int(re.search(r"STACK:(\d+)", usage).group(1)),
                shared_bytes=kernel.metadata.shared, instructions=total,
                per_element=round(total / elements_per_thread, 1),
                tile_instructions=executed,
                loop_per_element=round(executed / elements_per_thread, 1),
                opcodes=dict(ops.most_common()))


def issue_ceiling(per_element: float, bytes_per_element: float, gbps: float, sms: int, ghz: float,
                  issue_per_cycle: int = 128) -> float:
    """The fraction of the copy floor a kernel of ``per_element`` instructions an element can reach
    when instruction issue (``issue_per_cycle`` thread-instructions a cycle and SM) is its limit:
    at the floor an SM must retire ``gbps / (sms * ghz) / bytes_per_element`` elements a cycle
    (benchmarks/NOTES.md, "an issue-rate ceiling").

    Example:
        >>> round(issue_ceiling(21.5, 2, 2950, 132, 1.755), 2)  # the bf16 forward at D=256 H=1
        0.94
    """
    elements_per_cycle = gbps / (sms * ghz) / bytes_per_element
    return min(1.0, issue_per_cycle / (per_element * elements_per_cycle))


def point_report(args, kind: str, D: int, H: int, dtype_name: str) -> dict:
    """`sass_report` of one (kind, D, H, dtype) launch plan (and of the split or two-pass
    backward's second kernel), with its issue ceiling on the GPU that ``args`` describe."""
    dtype = DTYPES[dtype_name]
    plan, cfg, source, kernel_args = build_plan(kind, D, H, dtype, table=args.table, knobs=args.knobs,
                                                   affine=args.affine == "per_feature")
    if args.tanh_mode is not None:
        plan.meta["FAST_TANH"] = args.tanh_mode
    plan.meta.update(args.meta or {})
    # the forward launches with Triton's default num_stages (3), the backward with its config's
    kernel = compile_offline(plan.launcher.jit_fn, kernel_args, plan.meta, cfg.num_warps,
                             getattr(cfg, "num_stages", 3), args.arch, getattr(cfg, "maxnreg", 0))
    # elements of a row tile a thread handles: the real D where the kernel walks no padded columns
    # (the chunked row forward, the two-part row backward), BLOCK_D's padded lanes elsewhere
    real_d = plan.meta.get("BLOCK_K", cfg.block_d) < cfg.block_d if kind == "forward" else "BLOCK_D2" in plan.meta
    # the two-pass backward's kernels hold [rows, BLOCK_K] tiles
    tile_d = plan.meta["BLOCK_K"] if getattr(plan, "two_pass", False) else (D if real_d else cfg.block_d)
    # Backward kernels walk their row tiles in a loop, as a persistent forward does; the chunked
    # kernels walk BLOCK_K-column chunks in loops inside
    block_k = plan.meta.get("BLOCK_K") or cfg.block_d
    trips = -(-D // block_k) if not getattr(plan, "two_pass", False) else 1
    row_loop = kind == "backward" or bool(getattr(cfg, "persistent", 0))
    report = sass_report(kernel, cfg.block_b * tile_d / (32 * cfg.num_warps), row_loop, trips)
    per_element = report["loop_per_element"]
    if kind == "backward" and getattr(plan, "weight_meta", None) is not None:
        # the split backward's weight-gradient kernel, or the two-pass backward's second kernel
        # (dx and the partials, on the first kernel's arguments): both walk every element again
        second, second_args = ((launch._launch_bwd_two_pass, kernel_args) if plan.two_pass
                               else (launch._launch_bwd_weight, weight_kernel_args(plan, kernel_args)))
        wk = compile_offline(second.jit_fn, second_args, plan.weight_meta, cfg.dw_num_warps, cfg.dw_num_stages,
                             args.arch)
        wr = sass_report(wk, cfg.dw_block_b * plan.weight_meta["BLOCK_K"] / (32 * cfg.dw_num_warps), True)
        wr["role"] = "dx-and-partials" if plan.two_pass else "weight-gradient"
        report["second_kernel"] = wr
        per_element += wr["loop_per_element"]
    # bytes of traffic an element of x: x read (forward), x read and dx written (backward); y and
    # grad_y add H / D of that
    itemsize = dtype.itemsize * (1 if kind == "forward" else 2) * (1 + H / D)
    report["issue_ceiling_pct"] = round(100 * issue_ceiling(per_element, itemsize, args.gbps, args.sms,
                                                            args.ghz), 1)
    report.update(kind=kind, D=D, H=H, dtype=dtype_name, arch=args.arch, config_source=source,
                  config=configs.config_to_entry(cfg), triton=triton.__version__, row_loop_per_element=per_element,
                  constexprs={k: str(v) for k, v in plan.meta.items()})
    return report


def _sweep_point(job):
    args, kind, D, H, dtype_name = job
    try:
        r = point_report(args, kind, D, H, dtype_name)
        r.pop("constexprs", None)
        return r
    except (SystemExit, Exception) as err:  # noqa: BLE001 - a point that does not compile is a row saying so
        return dict(kind=kind, D=D, H=H, dtype=dtype_name, error=f"{type(err).__name__}: {err}")


def sweep(args) -> int:
    """Every (D, H, dtype) of ``--dims/--hs/--dtypes``, forward and backward: registers, spills and
    row-loop instructions an element, the issue ceilings of the forward and of a training step
    (forward + backward), and beside them (``--grid-json``) what the grid measured there (per-feature
    LayerNorm affine, mean over layouts): a point far below its ceiling waits on memory latency,
    one near it is instruction-bound."""
    from concurrent.futures import ProcessPoolExecutor

    jobs = [(args, kind, D, H, dt) for dt in args.dtypes for H in args.hs for D in args.dims
            for kind in ("forward", "backward")]
    with ProcessPoolExecutor(args.workers) as pool:
        reports = list(pool.map(_sweep_point, jobs))
    measured = {}
    if args.grid_json:
        with open(args.grid_json) as f:
            for p in json.load(f)["points"]:
                if p.get("affine") == "per_feature" and "train_pct_floor" in p:
                    measured.setdefault((p["dtype"], p["D"], p["H"]), []).append((p["fwd_pct_floor"], p["train_pct_floor"]))
    by_point = {(r["dtype"], r["D"], r["H"], r["kind"]): r for r in reports}
    lines = [f"sm_{args.arch}, triton {triton.__version__}, table {args.table}; ceilings at {args.gbps:.0f} GB/s, "
             f"{args.sms} SMs, {args.ghz} GHz (128 thread-instructions a cycle and SM)",
             f"{'dtype':5s} {'D':>4s} {'H':>3s} | {'fwd regs':>8s} {'instr/el':>8s} {'ceiling':>7s} {'measured':>8s} | "
             f"{'bwd regs':>8s} {'stack':>5s} {'instr/el':>8s} | {'step ceiling':>12s} {'measured':>8s}"]
    rows = []
    for dt in args.dtypes:
        for H in args.hs:
            for D in args.dims:
                fw, bw = by_point[(dt, D, H, "forward")], by_point[(dt, D, H, "backward")]
                if "error" in fw or "error" in bw:
                    lines.append(f"{dt:5s} {D:4d} {H:3d} | {fw.get('error') or bw.get('error')}")
                    continue
                itemsize = DTYPES[dt].itemsize * (1 + H / D)
                step = 100 * issue_ceiling(fw["row_loop_per_element"] + bw["row_loop_per_element"], 3 * itemsize,
                                           args.gbps, args.sms, args.ghz)
                got = measured.get((dt, D, H))
                fwd_got = f"{sum(g[0] for g in got) / len(got):.0f}%" if got else "-"
                train_got = f"{sum(g[1] for g in got) / len(got):.0f}%" if got else "-"
                bwd_regs = str(bw["registers"]) + (f"+{bw['second_kernel']['registers']}" if "second_kernel" in bw else "")
                lines.append(f"{dt:5s} {D:4d} {H:3d} | {fw['registers']:8d} {fw['row_loop_per_element']:8.1f} "
                             f"{fw['issue_ceiling_pct']:6.0f}% {fwd_got:>8s} | {bwd_regs:>8s} {bw['stack_bytes']:5d} "
                             f"{bw['row_loop_per_element']:8.1f} | {step:11.0f}% {train_got:>8s}")
                rows.append(dict(dtype=dt, D=D, H=H, step_issue_ceiling_pct=round(step, 1), forward=fw, backward=bw,
                                 measured_fwd_train_pct=got))
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=args.arch, triton=triton.__version__, table=args.table, gbps=args.gbps, sms=args.sms,
                           ghz=args.ghz, points=rows), f, indent=1)
    if args.txt:
        with open(args.txt, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=["forward", "backward"], default="forward")
    ap.add_argument("--D", type=int, default=256)
    ap.add_argument("--H", type=int, default=1)
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    ap.add_argument("--table", default="h100-80gb-hbm3",
                    help='tuned table whose lookup to compile (its nearest entry; "none": the heuristic)')
    ap.add_argument("--knobs", type=json.loads, default=None, help="config knobs (JSON), over the heuristic's")
    ap.add_argument("--affine", choices=["per_feature", "none"], default="per_feature", help="LayerNorm affine")
    ap.add_argument("--meta", type=json.loads, default=None,
                    help="constexprs (JSON) set over the plan's, e.g. a kernel flag no config knob reaches yet")
    ap.add_argument("--tanh-mode", type=int, choices=[0, 1, 2], help="FAST_TANH instead of a CUDA call's")
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    ap.add_argument("--top", type=int, default=16, help="opcodes shown")
    ap.add_argument("--gbps", type=float, default=2950.0, help="copy bandwidth of the GPU (the floor's unit; H100 2950)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--ghz", type=float, default=1.755, help="SM clock under load")
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--sweep", action="store_true",
                    help="every --dims x --hs x --dtypes point, forward and backward, as one table")
    ap.add_argument("--dims", type=int, nargs="+", default=[32, 48, 64, 128, 160, 256, 512])
    ap.add_argument("--hs", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--workers", type=int, default=2, help="--sweep: compiling processes")
    ap.add_argument("--grid-json", help="--sweep: a grid result whose measured %% of the floor to show beside")
    ap.add_argument("--txt", help="--sweep: also write the table here")
    args = ap.parse_args(argv)
    if args.sweep:
        return sweep(args)
    report = point_report(args, args.kind, args.D, args.H, args.dtype)
    print(f"{args.kind} D={args.D} H={args.H} {args.dtype} sm_{args.arch}, triton {triton.__version__}; "
          f"config ({report['config_source']}): {report['config']}")
    print(f"registers {report['registers']}, stack {report['stack_bytes']} B, shared {report['shared_bytes']} B; "
          f"{report['instructions']} SASS instructions, {report['per_element']} an element of a row tile "
          f"({report['loop_per_element']} in the row loop); if issue-bound, at most "
          f"{report['issue_ceiling_pct']}% of the copy floor")
    print("  " + ", ".join(f"{op} {n}" for op, n in list(report["opcodes"].items())[:args.top]))
    wr = report.get("second_kernel")
    if wr is not None:
        print(f"{wr['role']} kernel: registers {wr['registers']}, stack {wr['stack_bytes']} B, shared "
              f"{wr['shared_bytes']} B; {wr['per_element']} SASS instructions an element of its tile "
              f"({wr['loop_per_element']} in its loop)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
