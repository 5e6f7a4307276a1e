"""One-off A/B on the GPU: bf16 backward with bf16 tensor-core dots (dz hi+lo) vs fp32 operands
(3xTF32), accuracy vs float64 and vs PyTorch's own bf16 autograd; plus the saved-stats probe."""
import json, os, sys, time
import torch, triton.language as tl
sys.path.insert(0, "benchmarks")
from _common import do_bench_us, environment
from tune_kernels import make_inputs
from recfuse.ops import launch, configs
from recfuse.ops.composite import composite_backward
from recfuse.reference import batched_ln_tanh_linear_relu

out = {"env": environment("cuda"), "ab": [], "stats_probe": []}
def rel(a, r): return ((a.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
orig = launch._bwd_dot_dtype

def run_plan(t, stats, force_stats=False):
    launch._BACKWARD_PLANS.clear()
    plan = launch._build_backward_plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], 1e-5, 1, stats)
    if force_stats:
        plan.meta["LOAD_STATS"] = True
    s = stats if plan.meta["LOAD_STATS"] else None
    fn = lambda: plan(t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], s)
    g = fn(); torch.cuda.synchronize()
    return g, do_bench_us(fn, warmup_ms=10, rep_ms=40), plan

for D, H in [(32, 16), (64, 4), (64, 16), (64, 64), (128, 16), (128, 64), (160, 16), (256, 16), (256, 64), (512, 16)]:
    for dt in ["bf16", "fp32"]:
        if dt == "fp32" and H not in (16,):
            continue
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        F = 64; B = max(64, int(256 * 2**20 / (F * D * dtype.itemsize)) // 64 * 64)
        t = make_inputs(dict(F=F, B=B, D=D, H=H, dtype=dt), "cuda")
        f64 = {k: v.double() for k, v in t.items()}
        ref = composite_backward(f64["gy"], f64["x"], f64["w"], f64["b"], f64["lw"], f64["lb"], 1e-5, 1)
        # PyTorch's own autograd of the batched composite in the input dtype
        leaves = [t[k].detach().clone().requires_grad_() for k in ("x", "w", "b", "lw", "lb")]
        y = batched_ln_tanh_linear_relu(*leaves, 1e-5, 1)
        tg = torch.autograd.grad(y, leaves, t["gy"])
        names = ["dx", "dw", "db", "dlnw", "dlnb"]
        row = dict(D=D, H=H, dtype=dt, B=B, torch_err={n: rel(g, r) for n, g, r in zip(names, tg, ref)})
        yk, stats = launch.forward(t["x"], t["w"], t["b"], t["lw"], t["lb"], 1e-5, 1, save_stats=True)
        variants = [("new", orig)] if dt == "fp32" else [("new", orig), ("fp32_ops", lambda *a: tl.float32)]
        for name, fn_dtype in variants:
            launch._bwd_dot_dtype = fn_dtype
            try:
                g, us, plan = run_plan(t, stats)
                row[name] = dict(us=us, err={n: rel(a, r) for n, a, r in zip(names, g, ref)},
                                 cfg=configs.config_to_entry(plan.cfg), dot_dtype=str(plan.meta["BWD_DOT_DTYPE"]))
                if plan.cfg.use_dot:
                    g2, us2, _ = run_plan(t, stats, force_stats=True)
                    row[name + "_loadstats"] = dict(us=us2, err={n: rel(a, r) for n, a, r in zip(names, g2, ref)})
            except Exception as e:
                row[name] = dict(error=repr(e)[:300])
            finally:
                launch._bwd_dot_dtype = orig
        # saved-stats probe: the forward's stats against torch's
        xd = t["x"].double()
        mean = xd.mean(-1); rstd = 1 / torch.sqrt(xd.var(-1, unbiased=False) + 1e-5)
        row["stats_err"] = dict(mean=(stats[0].double() - mean.T).abs().max().item(),
                                rstd=((stats[1].double() - rstd.T) / rstd.T).abs().max().item())
        print(json.dumps(row), flush=True)
        out["ab"].append(row)
        del t, f64, ref, leaves, y, tg
        torch.cuda.empty_cache()
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "ab_bwd16_h100.json"), "w"), indent=1)
