"""One-off: where transform's forward (no grad) spends its host time over the op's, on the GPU host."""
import cProfile, pstats, sys, time, torch
sys.path.insert(0, "benchmarks")
import recfuse
from recfuse.fx import runtime, graph_module
from _common import PerSlice
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
F, B, D, H = (16, 1024, 256, 1) if dev == "cuda" else (2, 4, 8, 1)
torch.manual_seed(0)
buf = torch.randn(B, F * D, device=dev)
fused = recfuse.transform(PerSlice(F, D, H).to(dev), (buf,))
w, b = fused.linear.weight, fused.linear.bias
lw, lb = fused.recfuse_g0_ln_weight, fused.recfuse_g0_ln_bias
x3 = buf.view(B, F, D)
op = recfuse.ln_tanh_linear_relu
where = "here"
def timeit(fn, n=3000 if dev == "cuda" else 5):
    best = 1e9
    for _ in range(5):
        with torch.no_grad():
            fn(); torch.cuda.synchronize() if dev == "cuda" else None
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize() if dev == "cuda" else None
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best
rows = {
    "transform .forward": lambda: fused.forward(buf),
    "transform call": lambda: fused(buf),
    "op, graph's kwargs (1)": lambda: op(x3, w, b, ln_weight=lw, ln_bias=lb, eps=1e-5, feature_dim=1),
    "transform call (2)": lambda: fused(buf),
    "transform .forward (2)": lambda: fused.forward(buf),
    "op, graph's kwargs": lambda: op(x3, w, b, ln_weight=lw, ln_bias=lb, eps=1e-5, feature_dim=1),
    "op on slices_view output": lambda: op(runtime.slices_view(buf, 1, 0, F, D), w, b, ln_weight=lw, ln_bias=lb, eps=1e-5, feature_dim=1),
    "check_specialized": lambda: runtime.check_specialized((buf, "split", D, 1), "pieces", F, f"len(split(x, {D}))", where),
    "slices_view": lambda: runtime.slices_view(buf, 1, 0, F, D),
    "read_attrs": lambda: graph_module.read_attrs(fused, (("linear", "weight"), ("linear", "bias"), ("recfuse_g0_ln_weight",), ("recfuse_g0_ln_bias",))),
    "plain_call": lambda: graph_module._plain_call(fused),
    "buf.view": lambda: buf.view(B, F, D),
}
for name, fn in rows.items():
    print(f"{name:28s} {timeit(fn):7.2f} us", flush=True)
print(fused.code)
for name in ():
    pr = cProfile.Profile()
    with torch.no_grad():
        pr.enable()
        for _ in range(2000 if dev == "cuda" else 3):
            rows[name]()
        pr.disable()
    print("==", name)
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
