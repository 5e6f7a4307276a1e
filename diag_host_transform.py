"""One-off (session 10): where a transformed model's forward spends its host time on CUDA.
host_overhead_h100.txt has transform's no-grad forward at 72.9 us against the op's 31.1 on the
same host (the CPU machine: +8 us). cProfile of the rows host_overhead.py builds, 300 calls each."""
import cProfile
import io
import pstats
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import host_overhead as ho  # noqa: E402

rows, _ = ho.build_rows(16, 1024, 256, 1, torch.float32)
for name in ("op forward, no grad", "transform forward, no grad", "FFP forward, no grad", "transform forward, autograd"):
    fn = rows[name]
    for _ in range(300):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        fn()
    torch.cuda.synchronize()
    us = (time.perf_counter() - t0) * 1e3
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    print(f"== {name}: {us:.1f} us/call, {st.total_calls / 300:.0f} Python calls/call")
    st.sort_stats("tottime").print_stats(14)
    print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:4000])
