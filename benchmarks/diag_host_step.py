"""One-off: where the op's training step spends its host time on the GPU host (issue 15)."""
import collections, cProfile, io, json, os, pstats, statistics, sys, threading, time
import torch
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "benchmarks"))
import recfuse
import importlib; M = importlib.import_module("recfuse.ops.ln_tanh_linear_relu")
from recfuse.ops import launch as L
from _common import op_inputs, loop_us, training_step_call, environment
from host_overhead import _NoOpAutogradOp, bare_triton_launch

out_dir = os.environ.get("OUT", ".")
res = {"env": environment("cuda"), "threads0": [t.name for t in threading.enumerate()],
       "switchinterval": sys.getswitchinterval(), "affinity": len(os.sched_getaffinity(0)),
       "loadavg": os.getloadavg()}
inp = op_inputs(16, 1024, 256, 1, torch.float32, "cuda", layout="BFD", ln="per_feature")
params = inp.params()
for p in params:
    p.requires_grad_(True)
w, b, lw, lb = params
x3 = inp.x


def op():
    return recfuse.ln_tanh_linear_relu(x3, w, b, ln_weight=lw, ln_bias=lb, feature_dim=1)


def noop():
    return _NoOpAutogradOp.apply(x3, *params)


acc = collections.defaultdict(list)
prof = {"pr": None}


def wrap_static(cls, name, tag):
    orig = getattr(cls, name)

    def wrapped(*a, **k):
        t0 = time.perf_counter()
        acc[tag + ".enter"].append(t0)
        pr = prof["pr"]
        if pr is not None and tag == "Function.backward":
            pr.enable()
        r = orig(*a, **k)
        if pr is not None and tag == "Function.backward":
            pr.disable()
        t1 = time.perf_counter()
        acc[tag + ".inside"].append(t1 - t0)
        acc[tag + ".exit"].append(t1)
        return r
    setattr(cls, name, staticmethod(wrapped) if isinstance(cls.__dict__.get(name), staticmethod) else wrapped)


wrap_static(M._EagerLnTanhLinearRelu, "backward", "Function.backward")
wrap_static(_NoOpAutogradOp, "backward", "noop.backward")
orig_lb = L.backward


def timed_launch_backward(*a, **k):
    t0 = time.perf_counter()
    r = orig_lb(*a, **k)
    acc["launch.backward"].append(time.perf_counter() - t0)
    return r


L.backward = timed_launch_backward
orig_plan_call = L.BackwardPlan.__call__


def timed_plan_call(self, *a):
    t0 = time.perf_counter()
    r = orig_plan_call(self, *a)
    acc["BackwardPlan.__call__"].append(time.perf_counter() - t0)
    acc["bound?"].append(self.bound is not None and self.bound_reduce is not None)
    return r


L.BackwardPlan.__call__ = timed_plan_call


def segments(fn, tag, n=300):
    for k in list(acc):
        acc[k].clear()
    seg = collections.defaultdict(list)
    for i in range(n + 30):
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        y = fn()
        t1 = time.perf_counter()
        s = y.sum()
        t2 = time.perf_counter()
        s.backward()
        t3 = time.perf_counter()
        if i >= 30:
            seg["fwd"].append(t1 - t0)
            seg["sum"].append(t2 - t1)
            seg["backward()"].append(t3 - t2)
            enter = acc[tag + ".enter"][-1]
            ex = acc[tag + ".exit"][-1]
            seg["engine: call -> our backward"].append(enter - t2)
            seg["our backward"].append(ex - enter)
            seg["engine: our backward -> return"].append(t3 - ex)
    torch.cuda.synchronize()
    med = {k: statistics.median(v) * 1e6 for k, v in seg.items()}
    for k in ("launch.backward", "BackwardPlan.__call__"):
        if acc[k]:
            med[k] = statistics.median(acc[k][-n:]) * 1e6
    if acc["bound?"]:
        med["bound"] = all(acc["bound?"][-n:])
    return med


launch = bare_triton_launch()
res["bare_launch_us"] = loop_us(launch, 500)
res["tanh_us"] = loop_us(lambda t=torch.randn(1024, device="cuda"): torch.tanh(t), 500)
res["op_step_us"] = loop_us(training_step_call(op, params), 300)
res["noop_step_us"] = loop_us(training_step_call(noop, params), 300)
res["seg_op"] = segments(op, "Function.backward")
res["seg_noop"] = segments(noop, "noop.backward")
res["threads_after"] = [t.name for t in threading.enumerate()]

# variants
with torch.autograd.set_multithreading_enabled(False):
    res["op_step_us_no_mt"] = loop_us(training_step_call(op, params), 300)
    res["noop_step_us_no_mt"] = loop_us(training_step_call(noop, params), 300)
    res["seg_op_no_mt"] = segments(op, "Function.backward")
old = sys.getswitchinterval()
sys.setswitchinterval(1e-5)
res["op_step_us_si"] = loop_us(training_step_call(op, params), 300)
res["noop_step_us_si"] = loop_us(training_step_call(noop, params), 300)
sys.setswitchinterval(old)
gy = torch.ones(1024, 16, 1, device="cuda")


def grad_step():
    y = op()
    torch.autograd.grad(y, params, gy)


res["op_autograd_grad_us"] = loop_us(grad_step, 300)

# cProfile inside our backward (device thread), and in the main thread
pr = cProfile.Profile()
prof["pr"] = pr
segments(op, "Function.backward", n=200)
prof["pr"] = None
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
res["cprofile_device_thread"] = s.getvalue()
pr2 = cProfile.Profile()
step = training_step_call(op, params)
pr2.enable()
for _ in range(200):
    step()
torch.cuda.synchronize()
pr2.disable()
s = io.StringIO()
pstats.Stats(pr2, stream=s).sort_stats("tottime").print_stats(25)
res["cprofile_main_thread"] = s.getvalue()

# torch.profiler CPU view of one step
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    for _ in range(20):
        step()
    torch.cuda.synchronize()
res["torch_profiler"] = p.key_averages().table(sort_by="cpu_time_total", row_limit=30)

for k, v in res.items():
    if isinstance(v, str):
        print(f"== {k}\n{v}")
    else:
        print(k, json.dumps(v, default=str) if not isinstance(v, float) else f"{v:.1f}")
with open(os.path.join(out_dir, "diag_host_step_after_h100.json"), "w") as f:
    json.dump(res, f, indent=1, default=str)
