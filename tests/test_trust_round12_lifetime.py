"""Red-team round 12a: lifetime, memory and concurrency of recfuse on CPU.

Findings (each a test below, failing before its fix):

* Two `recfuse.transform` calls in parallel threads: torch.fx patches nn.Module.__call__ and
  __getattr__ process-wide while it traces, so one thread's trace recorded the other's module calls
  (RecfuseError "neither a submodule of the model", intermittent) and the patches were restored
  out of order. Any other thread running a model while a transform traced (serving the eager
  model, say) had its module calls routed into that tracer: the same RecfuseError in the serving
  thread. Now recfuse's traces take one process-wide lock, and its tracer runs other threads'
  module calls and attribute reads as they are.
* A module argument's guard token was ``len(_CAPTURED_MODULES)``, a count: saved with the graph,
  it named another module in the process that loaded it (or in another thread transforming at the
  same moment), so a loaded graph accepted a different module argument and silently computed with
  its own copy. Tokens are random now, and an entry goes with its module.

Probed and correct (tests below keep them so):

* weakref + gc: inputs, outputs and autograd graphs of inference and training calls (with and
  without backward) of a transformed model, a FusedFeatureProcessor (tensor and dict inputs) and
  the op are freed; a deleted transformed model, the original model, a deleted FFP and their
  parameters are freed.
* Cache bounds: FFP plans (32) and bound calls (64), the op's ValidatedSignatures (4096) and the
  compiled CPU path's direct-call table (4096) over thousands of batch sizes.
* The same transformed model / FFP from 8 threads (inference, batch sizes 2..39, caches cleared so
  first calls of each signature race), training steps of separate copies in 8 threads, and
  gradient accumulation into one shared module from 8 threads: equal to serial calls. A model
  transformed in one thread and called in another.
* A transformed model and an FFP saved with torch.save and run in a `multiprocessing` spawn
  subprocess: equal to the parent's results.

Left as they are (reported): the compiled CPU path's `_CACHE` holds one compiled function per
variant (eps, D, H, dtypes, parameter kinds) and is not bounded: a caller sweeping eps or D
compiles (~1 s each) and keeps one per value; nothing of a user's tensors is in it. A model
running in another thread while *its own* transform traces it sees `self.training` as a traced
value (the tracer sets it on the module): not guarded. DataLoader workers were not probed
separately (2 cores); the spawn test covers pickling into a fresh process.
"""
from __future__ import annotations

import copy
import gc
import io
import multiprocessing as mp
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

import recfuse
from recfuse import FusedFeatureProcessor
from recfuse.fx import runtime
from recfuse.ops import _cpu_compiled

F, D, H = 4, 8, 3


class PerFeature(nn.Module):
    def __init__(self, f=F):
        super().__init__()
        self.lns = nn.ModuleList(nn.LayerNorm(D) for _ in range(f))
        self.lin = nn.Linear(D, H)

    def forward(self, x):
        xs = torch.split(x, D, dim=1)
        t = torch.stack([torch.tanh(ln(s)) for ln, s in zip(self.lns, xs)], dim=1)
        return torch.relu(self.lin(t)).flatten(1)


class Blocking(PerFeature):
    """Sleeps inside its forward while fx traces it, so that another thread acts meanwhile (a
    forward that set an Event is refused by transform: it changes state)."""

    def forward(self, x):
        if torch.fx._symbolic_trace.is_fx_tracing():
            time.sleep(1.0)
        return super().forward(x)


def alive(ref) -> bool:
    gc.collect()
    return ref() is not None


def make_ffp():
    torch.manual_seed(1)
    return FusedFeatureProcessor(list("abcd"), D, out_features=H)


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# -- findings: traces in parallel threads ----------------------------------------------------------

def test_a_model_run_in_another_thread_while_a_transform_traces_is_not_recorded():
    """Before: the serving thread's nn.LayerNorm call went into the tracing thread's tracer and
    raised RecfuseError ("neither a submodule of the model")."""
    blocking, served = Blocking(), PerFeature()
    x = torch.randn(5, F * D)
    with torch.no_grad():
        reference = served(x)
    out = {}
    th = threading.Thread(target=lambda: out.update(tm=recfuse.transform(blocking, (x,))))
    th.start()
    try:
        time.sleep(0.3)
        with torch.no_grad():
            expected = served(x)  # the same eager model, while the other thread traces
        torch.testing.assert_close(expected, reference)
    finally:
        th.join(30)
    assert close(out["tm"](x), blocking(x))


def test_two_transforms_in_parallel_threads_both_succeed():
    """Before: the second trace patched nn.Module.__call__ over the first one's; the first's module
    calls after that went to the other tracer (RecfuseError), or the patches were restored out of
    order."""
    blocking, other = Blocking(), PerFeature()
    x = torch.randn(5, F * D)
    out, errors = {}, []

    def run(key, model):
        try:
            out[key] = recfuse.transform(model, (x,))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    a = threading.Thread(target=run, args=("a", blocking))
    a.start()
    time.sleep(0.3)
    b = threading.Thread(target=run, args=("b", other))
    b.start()
    b.join(0.5)  # b traces now (before the fix) or waits for a's trace (after)
    a.join(60)
    b.join(60)
    assert not errors, errors
    assert close(out["a"](x), blocking(x)) and close(out["b"](x), other(x))
    assert nn.Module.__call__ is torch.fx._symbolic_trace._orig_module_call


def test_parallel_transforms_of_six_models():
    models = [PerFeature() for _ in range(6)]
    x = torch.randn(6, F * D)
    with ThreadPoolExecutor(6) as ex:
        tms = list(ex.map(lambda m: recfuse.transform(m, (torch.randn(5, F * D),)), models))
    assert all(close(t(x), m(x)) for t, m in zip(tms, models))


# -- finding: module-argument guard tokens -----------------------------------------------------------

def test_a_loaded_graph_refuses_a_module_argument_of_the_loading_process(monkeypatch):
    """Before: tokens were counts. Simulated: the saving process's first module argument got token
    0, and so did the loading process's; the loaded graph accepted the loading process's Linear
    and silently computed with its own copy of the saving process's."""
    from recfuse.puzzler import split_stack

    monkeypatch.setattr(runtime, "_CAPTURED_MODULES", {})
    x = torch.randn(4 * 5 * 8)
    fused = recfuse.transform(split_stack, (x, 4, 8, nn.Linear(8, 1)))
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    monkeypatch.setattr(runtime, "_CAPTURED_MODULES", {})  # another process
    mine = nn.Linear(8, 1)
    recfuse.transform(split_stack, (x, 4, 8, mine))
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with pytest.raises(recfuse.RecfuseError, match="argument `linear` was captured"):
        loaded(x, 4, 8, mine)


def test_module_argument_entries_go_with_their_module():
    from recfuse.puzzler import split_stack

    lin = nn.Linear(8, 1)
    x = torch.randn(4 * 5 * 8)
    fused = recfuse.transform(split_stack, (x, 4, 8, lin))
    before = len(runtime._CAPTURED_MODULES)
    fused(x, 4, 8, lin)
    del lin
    gc.collect()
    assert len(runtime._CAPTURED_MODULES) == before - 1
    with pytest.raises(recfuse.RecfuseError):
        fused(x, 4, 8, nn.Linear(8, 1))


# -- probed: lifetime ------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["transform", "ffp"])
def test_inputs_outputs_graphs_and_modules_are_freed(which):
    model = PerFeature()
    mod = recfuse.transform(model, (torch.randn(5, F * D),)) if which == "transform" else make_ffp()
    refs = []
    for B in (3, 7):
        with torch.no_grad():
            x = torch.randn(B, F * D)
            y = mod(x)
        refs += [weakref.ref(x), weakref.ref(y)]
        x = torch.randn(B, F * D, requires_grad=True)
        y = mod(x)
        y.sum().backward()
        refs += [weakref.ref(x), weakref.ref(y), weakref.ref(x.grad)]
        x2 = torch.randn(B, F * D, requires_grad=True)
        y2 = mod(x2)  # a graph never run backward
        refs += [weakref.ref(x2), weakref.ref(y2)]
    del x, y, x2, y2
    assert not any(alive(r) for r in refs)
    owners = [weakref.ref(mod), weakref.ref(model)] + [weakref.ref(p) for p in mod.parameters()]
    del mod, model
    assert not any(alive(r) for r in owners)


def test_ffp_dict_inputs_and_op_tensors_are_freed():
    fp = make_ffp()
    d = {n: torch.randn(3, D, requires_grad=True) for n in "abcd"}
    y = fp(d)
    sum(v.sum() for v in (y.values() if isinstance(y, dict) else [y])).backward()
    refs = [weakref.ref(v) for v in d.values()]
    w, x = torch.randn(H, D, requires_grad=True), torch.randn(F, 6, D, requires_grad=True)
    recfuse.ln_tanh_linear_relu(x, w).sum().backward()
    refs += [weakref.ref(w), weakref.ref(x)]
    del d, y, w, x
    assert not any(alive(r) for r in refs)


def test_caches_stay_bounded_over_many_batch_sizes():
    from recfuse.ops import ln_tanh_linear_relu as _  # noqa: F401
    import importlib

    op = importlib.import_module("recfuse.ops.ln_tanh_linear_relu")
    fp = FusedFeatureProcessor(["a", "b"], 4, out_features=2)
    with torch.no_grad():
        for B in range(1, 301):
            fp(torch.randn(B, 8))
            recfuse.ln_tanh_linear_relu(torch.randn(2, B, 4), torch.randn(2, 4))
    assert len(fp._plans) <= fp._plans.max_plans == 32
    assert len(fp._bound) <= fp._bound.max_calls == 64
    assert len(op._VALIDATED.known) <= op._VALIDATED.limit
    assert len(_cpu_compiled._DIRECT.calls) <= _cpu_compiled._DIRECT.limit


# -- probed: threads -------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["transform", "ffp"])
def test_one_module_from_eight_threads_equals_serial(which):
    torch.manual_seed(0)
    mod = recfuse.transform(PerFeature(), (torch.randn(5, F * D),)) if which == "transform" else make_ffp()
    xs = [torch.randn(B, F * D) for B in range(2, 26)]
    with torch.no_grad():
        serial = [mod(x) for x in xs]
    _cpu_compiled.clear_cache()  # first calls of each signature race
    with torch.no_grad(), ThreadPoolExecutor(8) as ex:
        par = list(ex.map(mod, xs * 2))
    assert all(close(y, serial[i % len(xs)]) for i, y in enumerate(par))

    copies = [copy.deepcopy(mod) for _ in range(6)]

    def step(i):
        m, x = copies[i], xs[3 * i].clone().requires_grad_(True)
        y = m(x)
        (y * torch.linspace(0, 1, y.shape[1])).sum().backward()
        return [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]

    ser = [step(i) for i in range(6)]
    for c in copies:
        c.zero_grad(set_to_none=True)
    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(step, range(6)))
    assert all(close(a, b) for s, g in zip(ser, got) for a, b in zip(s, g))

    mod.zero_grad(set_to_none=True)
    for x in xs[:8]:
        mod(x.clone().requires_grad_(True)).sum().backward()
    accumulated = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda x: mod(x.clone().requires_grad_(True)).sum().backward(), xs[:8]))
    assert all(torch.allclose(p.grad, a, rtol=1e-4, atol=1e-5) for p, a in zip(mod.parameters(), accumulated))


def test_transformed_in_one_thread_called_in_another():
    model, x = PerFeature(), torch.randn(6, F * D)
    out = {}
    th = threading.Thread(target=lambda: out.update(tm=recfuse.transform(model, (x,))))
    th.start()
    th.join(60)
    assert close(out["tm"](x), model(x))


# -- probed: processes -----------------------------------------------------------------------------

def _child(path, queue):
    import torch as t
    tm, fp, x = t.load(path, weights_only=False)
    with t.no_grad():
        queue.put((tm(x).tolist(), fp(x).tolist()))  # lists: tensors would go through shared memory


def test_saved_modules_run_in_a_spawn_subprocess(tmp_path):
    tm = recfuse.transform(PerFeature(), (torch.randn(5, F * D),))
    fp, x = make_ffp(), torch.randn(9, F * D)
    path = str(tmp_path / "m.pt")
    torch.save((tm, fp, x), path)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(path, queue))
    p.start()
    got = queue.get(timeout=120)
    p.join(60)
    assert p.exitcode == 0
    with torch.no_grad():
        assert close(torch.tensor(got[0]), tm(x)) and close(torch.tensor(got[1]), fp(x))


class _SlowPerFeature(PerFeature):
    """Sleeps in forward (also while traced): the GIL goes to other threads mid-trace."""

    def forward(self, x):
        time.sleep(0.02)
        return super().forward(x)


def test_grad_mode_changes_of_another_thread_are_not_recorded_into_a_trace():
    """The capture's grad-mode, print, setattr and Function patches are process-wide: another
    thread's `torch.no_grad()` while a transform traced was recorded into that trace's graph
    (a parallel transform failed with "Argument 'grad_enabled_6' of Node 'set_grad_mode_2' does not
    belong to this Graph"; an eager model served beside it put grad-mode nodes into the result)."""
    stop = threading.Event()
    other, x_other = PerFeature(), torch.randn(3, F * D)

    def serve():
        while not stop.is_set():
            with torch.no_grad():
                other(x_other)
            with torch.enable_grad():
                other(x_other).sum()

    server = threading.Thread(target=serve)
    server.start()
    try:
        models = [_SlowPerFeature() for _ in range(4)]
        results = [recfuse.transform(m, (torch.randn(5, F * D),)) for m in models]
    finally:
        stop.set()
        server.join()
    x = torch.randn(6, F * D)
    for t, m in zip(results, models):
        assert not any(n.target is runtime.set_grad_mode for n in t.graph.nodes), t.code
        assert close(t(x), m(x))
