import json, sys, torch, triton.language as tl
sys.path.insert(0, "benchmarks")
from _common import do_bench_us
from tune_kernels import make_inputs
from recfuse.ops import launch
from recfuse.chain import DEFAULT, chain_of
from recfuse.ops.composite import composite_backward
def rel(a, r): return ((a.double() - r).norm() / r.norm().clamp_min(1e-30)).item()
orig = launch._bwd_dot_dtype
for D, H, chain in [(256, 16, DEFAULT), (64, 64, DEFAULT), (128, 16, chain_of("layer_norm", "gelu", "sigmoid"))]:
    t = make_inputs(dict(F=64, B=max(64, int(128 * 2**20 / (64 * D * 2)) // 64 * 64), D=D, H=H, dtype="bf16"), "cuda")
    args = (t["gy"], t["x"], t["w"], t["b"], t["lw"], t["lb"], 1e-5, 1)
    ref = composite_backward(*[a.double() for a in args[:6]], 1e-5, 1, chain)
    row = {"D": D, "H": H, "chain": list(chain)}
    for name, fn in [("bf16_ops", orig), ("fp32_ops", lambda *a: tl.float32)]:
        launch._bwd_dot_dtype = fn; launch._BACKWARD_PLANS.clear()
        g = launch.backward(*args, chain=chain)
        row[name] = [round(rel(a, r), 6) for a, r in zip(g, ref)]
        row[name + "_us"] = round(do_bench_us(lambda: launch.backward(*args, chain=chain), warmup_ms=5, rep_ms=20), 1)
    launch._bwd_dot_dtype = orig
    print(json.dumps(row), flush=True)
