"""One-off: where transform's forward spends host time over the op's (no grad and autograd), GPU host."""
import cProfile, io, pstats, sys, time, torch
sys.path.insert(0, "benchmarks")
import recfuse
from recfuse.fx import runtime, graph_module
from _common import PerSlice, op_inputs
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
F, B, D, H = (16, 1024, 256, 1) if dev == "cuda" else (2, 4, 8, 1)
torch.manual_seed(0)
inp = op_inputs(F, B, D, H, torch.float32, dev, layout="BFD", ln="per_feature")
buf, x3 = inp.buf, inp.x
params = inp.params()
for p in params:
    p.requires_grad_(True)
fused = recfuse.transform(PerSlice(F, D, H).to(dev), (buf,))
w, b = fused.linear.weight, fused.linear.bias
lw, lb = fused.recfuse_g0_ln_weight, fused.recfuse_g0_ln_bias
op = recfuse.ln_tanh_linear_relu
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
def timeit(fn, grad, n=2000 if dev == "cuda" else 5):
    best = 1e9
    for _ in range(5):
        with torch.set_grad_enabled(grad):
            fn(); sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best
rows = {
    "op, op_inputs params": lambda: op(x3, *params[:2], ln_weight=params[2], ln_bias=params[3], feature_dim=1),
    "op, transform's params": lambda: op(x3, w, b, ln_weight=lw, ln_bias=lb, eps=1e-5, feature_dim=1),
    "op on slices_view, transform's params": lambda: op(runtime.slices_view(buf, 1, 0, F, D), w, b, ln_weight=lw, ln_bias=lb, eps=1e-5, feature_dim=1),
    "transform .forward": lambda: fused.forward(buf),
    "transform call": lambda: fused(buf),
    "op, op_inputs params (2)": lambda: op(x3, *params[:2], ln_weight=params[2], ln_bias=params[3], feature_dim=1),
    "transform call (2)": lambda: fused(buf),
    "slices_view": lambda: runtime.slices_view(buf, 1, 0, F, D),
    "read_attrs": lambda: graph_module.read_attrs(fused, (("linear", "weight"), ("linear", "bias"), ("recfuse_g0_ln_weight",), ("recfuse_g0_ln_bias",))),
}
for grad in (False, True):
    for name, fn in rows.items():
        print(f"{'autograd' if grad else 'no grad':8s} {name:40s} {timeit(fn, grad):7.2f} us", flush=True)
print(fused.code)
print({n: (p.shape, p.stride(), p.is_contiguous(), p.data_ptr() % 16) for n, p in fused.named_parameters()})
for name in ("op, transform's params", "transform call"):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000 if dev == "cuda" else 3):
        rows[name]()
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print("== autograd", name, s.getvalue()[:5000])
