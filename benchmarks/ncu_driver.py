"""One-off: run the fused forward (and backward) a few times at a grid shape, for ncu."""
import sys, torch, recfuse
dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
D, H = int(sys.argv[2]), int(sys.argv[3])
F = 64
B = int(256 * 2**20 / (F * D * dt.itemsize)) // 64 * 64
x = torch.randn(B, F * D, device="cuda", dtype=dt).view(B, F, D).requires_grad_(True)
w = (torch.randn(H, D, device="cuda") / D**0.5).to(dt).requires_grad_(True)
b = torch.zeros(H, device="cuda", dtype=dt).requires_grad_(True)
lw = torch.ones(F, D, device="cuda", dtype=dt).requires_grad_(True)
lb = torch.zeros(F, D, device="cuda", dtype=dt).requires_grad_(True)
for i in range(4):
    y = recfuse.ln_tanh_linear_relu(x, w, b, ln_weight=lw, ln_bias=lb, feature_dim=1)
    y.backward(torch.randn_like(y))
torch.cuda.synchronize()
