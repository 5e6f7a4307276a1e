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

from recfuse.ops import configs, launch

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
             if kind == "backward" and cfg.use_dot and min_d is not None and (D >= min_d or cfg.two_pass) and H <= 64
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


def compile_offline(jit_fn, args: tuple, meta: dict, num_warps: int, num_stages: int, arch: int = 90):
    """``triton.compile`` of ``jit_fn`` for a CUDA target of compute capability ``arch``, with the
    argument types, the JIT's specialisations and the constexprs a launch with ``args`` and ``meta`` has."""
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
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def cuobjdump(kernel, *flags: str) -> str:
    """cuobjdump (the one Triton ships) of a compiled kernel's cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([tool, *flags, f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(f.name)


def sass_report(kernel, elements_per_thread: float) -> dict:
    """Registers, stack bytes, shared memory, and SASS instructions (total, per element of one row
    tile per thread, by opcode) of a compiled kernel."""
    usage = cuobjdump(kernel, "-res-usage")
    ops = collections.Counter()
    for line in cuobjdump(kernel, "-sass").splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1)] += 1
    total = sum(ops.values())
    return dict(registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                stack_bytes=int(re.search(r"STACK:(\d+)", usage).group(1)),
                shared_bytes=kernel.metadata.shared, instructions=total,
                per_element=round(total / elements_per_thread, 1),
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
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype]
    plan, cfg, source, kernel_args = build_plan(args.kind, args.D, args.H, dtype, table=args.table, knobs=args.knobs,
                                                   affine=args.affine == "per_feature")
    if args.tanh_mode is not None:
        plan.meta["FAST_TANH"] = args.tanh_mode
    plan.meta.update(args.meta or {})
    # the forward launches with Triton's default num_stages (3), the backward with its config's
    kernel = compile_offline(plan.launcher.jit_fn, kernel_args, plan.meta, cfg.num_warps,
                             getattr(cfg, "num_stages", 3), args.arch)
    # elements of a row tile a thread handles: the real D where the kernel walks no padded columns
    # (the chunked row forward, the two-part row backward), BLOCK_D's padded lanes elsewhere
    real_d = plan.meta.get("BLOCK_K", cfg.block_d) < cfg.block_d if args.kind == "forward" else "BLOCK_D2" in plan.meta
    # the two-pass backward's kernels hold [rows, BLOCK_K] tiles
    tile_d = plan.meta["BLOCK_K"] if getattr(plan, "two_pass", False) else (args.D if real_d else cfg.block_d)
    report = sass_report(kernel, cfg.block_b * tile_d / (32 * cfg.num_warps))
    # bytes of traffic an element of x: x read (forward), x read and dx written (backward); y and
    # grad_y add H / D of that
    itemsize = dtype.itemsize * (1 if args.kind == "forward" else 2) * (1 + args.H / args.D)
    report["issue_ceiling_pct"] = round(100 * issue_ceiling(report["per_element"], itemsize, args.gbps, args.sms,
                                                            args.ghz), 1)
    report.update(kind=args.kind, D=args.D, H=args.H, dtype=args.dtype, arch=args.arch, config_source=source,
                  config=configs.config_to_entry(cfg), triton=triton.__version__,
                  constexprs={k: str(v) for k, v in plan.meta.items()})
    print(f"{args.kind} D={args.D} H={args.H} {args.dtype} sm_{args.arch}, triton {triton.__version__}; "
          f"config ({source}): {report['config']}")
    print(f"registers {report['registers']}, stack {report['stack_bytes']} B, shared {report['shared_bytes']} B; "
          f"{report['instructions']} SASS instructions, {report['per_element']} an element of a row tile; "
          f"if issue-bound, at most {report['issue_ceiling_pct']}% of the copy floor")
    print("  " + ", ".join(f"{op} {n}" for op, n in list(report["opcodes"].items())[:args.top]))
    if args.kind == "backward" and plan.weight_meta is not None:
        # the split backward's weight-gradient kernel, or the two-pass backward's second kernel
        # (dx and the partials, on the first kernel's arguments)
        second, second_args = ((launch._launch_bwd_two_pass, kernel_args) if plan.two_pass
                               else (launch._launch_bwd_weight, weight_kernel_args(plan, kernel_args)))
        wk = compile_offline(second.jit_fn, second_args, plan.weight_meta, cfg.dw_num_warps, cfg.dw_num_stages,
                             args.arch)
        wr = sass_report(wk, cfg.dw_block_b * plan.weight_meta["BLOCK_K"] / (32 * cfg.dw_num_warps))
        report["weight_kernel"] = wr
        print(f"{'dx-and-partials' if plan.two_pass else 'weight-gradient'} kernel: registers {wr['registers']}, "
              f"stack {wr['stack_bytes']} B, shared {wr['shared_bytes']} B; {wr['per_element']} SASS instructions "
              f"an element of its tile")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
