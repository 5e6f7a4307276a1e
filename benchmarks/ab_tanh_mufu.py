"""One-off A/B: fp32 FAST_TANH 0 (portable exact tanh) vs 2 (exact form on MUFU ex2/rcp), same configs."""
import json, sys, torch, triton, triton.testing
import recfuse
from recfuse import reference
from recfuse.ops import launch
F = 64
shapes = [(32, 1), (64, 1), (128, 1), (160, 1), (256, 1), (512, 1), (64, 4), (256, 4), (128, 16), (256, 16)]
orig = launch._tanh_mode
rows = []
copy_src = torch.empty(64 * 2**20, device="cuda"); copy_dst = torch.empty_like(copy_src)
copy_us = triton.testing.do_bench(lambda: copy_dst.copy_(copy_src), warmup=10, rep=40) * 1e3
gbps = 2 * copy_src.numel() * 4 / copy_us / 1e3
for D, H in shapes:
    B = int(256 * 2**20 / (F * D * 4)) // 64 * 64
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, F * D, device="cuda", generator=g).view(B, F, D).requires_grad_(True)
    w = (torch.randn(H, D, device="cuda", generator=g) / D**0.5).requires_grad_(True)
    b = (0.1 * torch.randn(H, device="cuda", generator=g)).requires_grad_(True)
    lw = (1 + 0.1 * torch.randn(F, D, device="cuda", generator=g)).requires_grad_(True)
    lb = (0.1 * torch.randn(F, D, device="cuda", generator=g)).requires_grad_(True)
    gy = torch.randn(B, F, H, device="cuda", generator=g)
    params = [x, w, b, lw, lb]
    def fwd():
        with torch.no_grad():
            return recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=1)
    def train():
        y = recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=1)
        return torch.autograd.grad(y, params, gy)
    n = 2048  # rows checked against float64
    xs = x.detach()[:n].double().requires_grad_(True)
    p64 = [w.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True),
           lw.detach().double().requires_grad_(True), lb.detach().double().requires_grad_(True)]
    y64 = reference.ln_tanh_linear_relu(xs, p64[0], p64[1], ln_weight=p64[2], ln_bias=p64[3], feature_dim=1)
    g64 = torch.autograd.grad(y64, [xs] + p64, gy[:n].double())
    row = dict(D=D, H=H, B=B, x_MB=x.numel() * 4 / 2**20)
    floor_fwd = (x.numel() + gy.numel()) * 4 / gbps / 1e3
    floor_train = floor_fwd + (2 * x.numel() + gy.numel()) * 4 / gbps / 1e3
    for mode in ("old", "new"):
        launch._tanh_mode = (lambda *a, **k: 0 if orig(*a, **k) == 2 else orig(*a, **k)) if mode == "old" else orig
        launch._FORWARD_PLANS.clear(); launch._BACKWARD_PLANS.clear()
        f_us = triton.testing.do_bench(fwd, warmup=10, rep=40) * 1e3
        t_us = triton.testing.do_bench(train, warmup=10, rep=40) * 1e3
        xg = x.detach()[:n].clone().requires_grad_(True)
        pg = [t.detach().clone().requires_grad_(True) for t in (w, b, lw, lb)]
        y = recfuse.ln_tanh_linear_relu(xg, pg[0], pg[1], ln_weight=pg[2], ln_bias=pg[3], feature_dim=1)
        grads = torch.autograd.grad(y, [xg] + pg, gy[:n])
        err = lambda a, r: ((a.double() - r).norm() / r.norm()).item()
        row[mode] = dict(fwd_us=f_us, train_us=t_us, fwd_pct=100 * floor_fwd / f_us, train_pct=100 * floor_train / t_us,
                         y_err=err(y, y64), grad_errs=[err(a, r) for a, r in zip(grads, g64)])
    row["fwd_speedup"] = row["old"]["fwd_us"] / row["new"]["fwd_us"]
    row["train_speedup"] = row["old"]["train_us"] / row["new"]["train_us"]
    rows.append(row)
    print(f"D={D:4d} H={H:3d} fwd {row['old']['fwd_us']:7.1f} -> {row['new']['fwd_us']:7.1f} us ({row['new']['fwd_pct']:.0f}%)"
          f"  train {row['old']['train_us']:7.1f} -> {row['new']['train_us']:7.1f} us ({row['new']['train_pct']:.0f}%)"
          f"  y err {row['old']['y_err']:.1e}/{row['new']['y_err']:.1e} grad max {max(row['new']['grad_errs']):.1e}", flush=True)
env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, copy_GBps=gbps)
json.dump(dict(env=env, rows=rows), open(sys.argv[1], "w"), indent=1)
