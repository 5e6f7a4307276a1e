"""One-off: fp32 H=16 dot-backward errors on the GPU by config / SUM_TILES / precision; determinism."""
import json, os, sys
import torch
sys.path.insert(0, "benchmarks")
from _common import do_bench_us, environment
from tune_kernels import make_inputs
from recfuse.ops import launch, configs
from recfuse.ops.composite import composite_backward
def rel(a, r): return ((a.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
rows = []
for D, H, dt in [(256, 16, "fp32"), (128, 16, "fp32"), (64, 16, "fp32"), (256, 16, "bf16"), (64, 16, "bf16")]:
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    F = 64; B = max(64, int(256 * 2**20 / (F * D * dtype.itemsize)) // 64 * 64)
    t = make_inputs(dict(F=F, B=B, D=D, H=H, dtype=dt), "cuda")
    f64 = {k: v.double() for k, v in t.items()}
    ref = composite_backward(f64["gy"], f64["x"], f64["w"], f64["b"], f64["lw"], f64["lb"], 1e-5, 1)
    del f64
    for sum_tiles in (True, False):
        for bb, warps, pps, stages in [(16, 8, 4, 1), (16, 4, 8, 1), (32, 4, 8, 1), (32, 8, 4, 1), (16, 4, 8, 2), (16, 8, 4, 2)]:
            for prec in (["tf32x3", "ieee"] if dt == "fp32" and bb == 16 and warps == 8 and stages == 1 else ["tf32x3"]):
                launch._SUM_TILES = sum_tiles
                launch._FP32_DOT_PRECISION = prec
                cfg = configs.heuristic_backward(D, H, dtype, block_b=bb, num_warps=warps, programs_per_sm=pps, num_stages=stages)
                row = dict(D=D, H=H, dtype=dt, sum_tiles=sum_tiles, bb=bb, warps=warps, pps=pps, stages=stages, prec=prec)
                try:
                    with configs.override(backward=cfg):
                        plan = launch.backward_plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], 1e-5, 1, None)
                    fn = lambda: plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], None)
                    g1 = fn(); g2 = fn(); torch.cuda.synchronize()
                    row["err"] = [round(rel(a, r), 9) for a, r in zip(g1, ref)]
                    row["bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(g1, g2))
                    row["us"] = round(do_bench_us(fn, warmup_ms=5, rep_ms=25), 1)
                except Exception as e:
                    row["error"] = repr(e)[:200]
                print(json.dumps(row), flush=True)
                rows.append(row)
    del t, ref
    torch.cuda.empty_cache()
json.dump({"env": environment("cuda"), "rows": rows}, open(os.path.join(os.environ.get("OUT", "."), "fp32_probe_h100.json"), "w"), indent=1)
