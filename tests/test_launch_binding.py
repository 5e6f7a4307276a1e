"""Every launch plan can bind its compiled kernel: after a signature's first call, later calls
launch the compiled kernel directly instead of going through `JITFunction.run`.

A plan whose constexprs leave out one that has a default in the kernel's signature (the whole-row
backward's ``PREFETCH``, absent when prefetch is off) was never cached: every fp32 backward and
every bf16 one without prefetch re-bound its ~30 arguments in `JITFunction.run` on every call (on
the H100 host ~1 of the training step's ~55 bare launches; the plan's `bound` stayed None).
The CPU tests build the plans of every config source (heuristic, prefetch on and off, the
K-chunked kernel, the shipped H100 table's entries) and check that the direct launch gets a value
for every kernel parameter; the CUDA test checks that real calls end up bound and still match
float64.
"""
import pytest
import torch
import triton
import triton.language as tl

import recfuse
from recfuse.ops import configs, launch

SHAPES = [(D, H, dtype) for D in (48, 64, 256, 512) for H in (1, 3, 16, 64)
          for dtype in (torch.float32, torch.bfloat16)]
TABLE = configs.load_table("h100-80gb-hbm3")


def _backward_sources(D, H, dtype):
    """(name, config) of every backward config a call of this shape may run."""
    heuristic = configs.heuristic_backward(D, H, dtype)
    if heuristic is None:
        return
    yield "heuristic", heuristic
    for prefetch in (0, 1):
        if heuristic.use_dot and not heuristic.block_k:
            yield f"prefetch={prefetch}", configs.heuristic_backward(D, H, dtype, prefetch=prefetch)
            yield f"split_dw prefetch={prefetch}", configs.heuristic_backward(D, H, dtype, prefetch=prefetch,
                                                                              split_dw=64)
    name = configs._DTYPE_NAMES[dtype]
    for (kind, d, h, dt, _), entry in TABLE.items():
        if kind == "backward" and d == D and h == H and dt == name:
            cfg = configs.config_from_entry("backward", entry, D, H, dtype)
            if cfg is not None:
                yield "h100 table", cfg


def _forward_sources(D, H, dtype):
    for full_tiles in (True, False):
        yield f"heuristic full_tiles={full_tiles}", full_tiles, configs.heuristic_forward(D, H, dtype, full_tiles)
    name = configs._DTYPE_NAMES[dtype]
    for (kind, d, h, dt, full_tiles), entry in TABLE.items():
        if kind == "forward" and d == D and h == H and dt == name:
            cfg = configs.config_from_entry("forward", entry, D, H, dtype, full_tiles)
            if cfg is not None:
                yield "h100 table", full_tiles, cfg


def _inputs(D, H, dtype, B=64, F=3):
    g = torch.Generator().manual_seed(D * 100 + H)
    x = torch.randn(F, B, D, generator=g).to(dtype)
    w = (torch.randn(H, D, generator=g) * D ** -0.5).to(dtype)
    b = torch.randn(H, generator=g).to(dtype)
    lw = (1 + 0.1 * torch.randn(F, D, generator=g)).to(dtype)
    lb = (0.1 * torch.randn(F, D, generator=g)).to(dtype)
    return x, w, b, lw, lb


def _assert_every_parameter_has_a_value(launcher, n_runtime, meta, what):
    trailing = launcher.trailing_args(range(n_runtime), meta)
    assert trailing is not None, f"{what}: a constexpr of {launcher.arg_names[n_runtime:]} has no value in {meta}"
    assert n_runtime + len(trailing) == len(launcher.arg_names), what


@pytest.mark.parametrize("D,H,dtype", SHAPES, ids=lambda v: str(v).replace("torch.", ""))
def test_every_backward_plan_gives_every_kernel_parameter_a_value(D, H, dtype):
    x, w, b, lw, lb = _inputs(D, H, dtype)
    gy = torch.randn(x.shape[0], x.shape[1], H).to(dtype)
    sources = list(_backward_sources(D, H, dtype))
    assert sources
    for name, cfg in sources:
        with configs.override(backward=cfg):
            plan = launch.backward_plan(gy, x, w, b, lw, lb, 1e-5, 0)
        assert plan is not None, name
        # 10 tensors (grad_y, x, the 4 parameters, dx, partials, stats, dz), then the integers.
        _assert_every_parameter_has_a_value(plan.launcher, 10 + len(plan.ints), plan.meta, f"backward {name} {cfg}")
        _assert_every_parameter_has_a_value(launch._launch_partials_to_grads, 5 + len(plan.reduce_ints),
                                            plan.reduce_meta, f"reduction {name}")
        if plan.weight_meta is not None:  # x, dz, stats, the LayerNorm affine, partials, the weight
            _assert_every_parameter_has_a_value(launch._launch_bwd_weight, 7 + len(plan.weight_ints),
                                                plan.weight_meta, f"weight gradient {name}")


@pytest.mark.parametrize("D,H,dtype", SHAPES, ids=lambda v: str(v).replace("torch.", ""))
def test_every_forward_plan_gives_every_kernel_parameter_a_value(D, H, dtype):
    x, w, b, lw, lb = _inputs(D, H, dtype)
    for name, full_tiles, cfg in _forward_sources(D, H, dtype):
        for save_stats in (False, True):
            with configs.override(forward=lambda *a, cfg=cfg: cfg):
                plan = launch.forward_plan(x, w, b, lw, lb, 1e-5, 0, save_stats=save_stats)
            # 7 tensors (x, the 4 parameters, y, stats), then the integers.
            _assert_every_parameter_has_a_value(plan.launcher, 7 + len(plan.ints), plan.meta,
                                                f"forward {name} {cfg} save_stats={save_stats}")


def test_a_left_out_constexpr_with_a_default_is_filled_and_one_without_is_not():
    from recfuse.ops import kernels
    from recfuse.ops._compiled_launch import CompiledLaunchCache

    cache = CompiledLaunchCache(kernels.ln_tanh_linear_relu_bwd)
    n = len(cache.arg_names)
    assert cache.arg_names[-9:] == ["PREFETCH", "UNROLL_H", "LOOP_STAGES", "COL_SUMS", "DZ_OUT", "LOAD_MASK",
                                    "LN_IN_WEIGHT", "ROW_SLOTS", "D_ALIGN"]
    defaults = [False, False, None, False, False, False, False, 0, 1]

    def expect(block_h, **set_):
        names = cache.arg_names[-9:]
        return [block_h] + [set_.get(name, d) for name, d in zip(names, defaults)]

    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 16}) == expect(16)
    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 16, "PREFETCH": True}) == expect(16, PREFETCH=True)
    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 4, "UNROLL_H": True}) == expect(4, UNROLL_H=True)
    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 1, "LOOP_STAGES": 3, "COL_SUMS": True}) == expect(
        1, LOOP_STAGES=3, COL_SUMS=True)
    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 16, "DZ_OUT": True}) == expect(16, DZ_OUT=True)
    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 16, "LOAD_MASK": True}) == expect(16, LOAD_MASK=True)
    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 16, "DZ_OUT": True, "LN_IN_WEIGHT": True}) == expect(
        16, DZ_OUT=True, LN_IN_WEIGHT=True)
    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 1, "ROW_SLOTS": 2}) == expect(1, ROW_SLOTS=2)
    assert cache.trailing_args(range(n - 10), {"BLOCK_H": 16, "D_ALIGN": 8}) == expect(16, D_ALIGN=8)
    assert cache.trailing_args(range(n - 10), {"PREFETCH": True}) is None


def _float64_grads(x, params, gy):
    x64 = x.detach().double().requires_grad_(True)
    p64 = [p.detach().double().requires_grad_(True) for p in params]
    y = recfuse.reference.ln_tanh_linear_relu(x64, p64[0], p64[1], ln_weight=p64[2], ln_bias=p64[3], feature_dim=1)
    y.backward(gy.double())
    return y.detach(), [x64.grad] + [p.grad for p in p64]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("D,H,dtype", [(256, 1, torch.float32), (256, 1, torch.bfloat16), (64, 16, torch.bfloat16),
                                       (64, 16, torch.float32), (160, 16, torch.float32), (512, 64, torch.float32),
                                       (48, 3, torch.bfloat16)], ids=str)
def test_cuda_training_steps_launch_bound_kernels_and_match_float64(D, H, dtype):
    F, B = 8, 1000
    g = torch.Generator(device="cuda").manual_seed(D + H)
    buf = torch.randn(B, F * D, device="cuda", generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(H, D, device="cuda", generator=g) * D ** -0.5).to(dtype).requires_grad_(True)
    b = (0.1 * torch.randn(H, device="cuda", generator=g)).to(dtype).requires_grad_(True)
    lw = (1 + 0.1 * torch.randn(F, D, device="cuda", generator=g)).to(dtype).requires_grad_(True)
    lb = (0.1 * torch.randn(F, D, device="cuda", generator=g)).to(dtype).requires_grad_(True)
    params = [w, b, lw, lb]
    gy = torch.randn(B, F, H, device="cuda", generator=g).to(dtype)
    # relu ties: where z is within rounding of 0, rounding decides the mask on any path
    # (8000 rows x 64 outputs hold a few within 1e-6 of 0).
    z64 = recfuse.reference.feature_mlp(buf.view(B, F, D).double(), *[p.double() for p in params[:2]],
                                        ln_weight=lw.double(), ln_bias=lb.double(), feature_dim=1,
                                        out_activation=None)
    gy = gy.masked_fill(z64.abs() < 1e-3, 0)
    y_ref, grads_ref = _float64_grads(buf.view(B, F, D), params, gy)
    launch._FORWARD_PLANS.clear()
    launch._BACKWARD_PLANS.clear()
    for _ in range(3):
        for t in [buf] + params:
            t.grad = None
        y = recfuse.ln_tanh_linear_relu(buf.view(B, F, D), w, b, ln_weight=lw, ln_bias=lb, feature_dim=1)
        y.backward(gy)
    plans = list(launch._FORWARD_PLANS.values()) + list(launch._BACKWARD_PLANS.values())
    assert plans
    for plan in plans:
        assert plan.bound is not None, plan
        if isinstance(plan, launch.BackwardPlan):
            assert plan.bound_reduce is not None, plan
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    got = [buf.grad.view(B, F, D)] + [p.grad for p in params]
    for name, a, r in zip(("y", "x", "w", "b", "ln_w", "ln_b"), [y] + got, [y_ref] + grads_ref):
        err = ((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
        assert err < tol, (name, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tanh_mode_per_device_dtype_and_chain(dtype):
    # 0 (portable exact form) off CUDA: the interpreter cannot run the MUFU forms' inline PTX.
    # 1 (MUFU tanh.approx) only for 16-bit values on CUDA, never where the exact form is asked
    # for (gelu) nor in the fp16 backward; every other CUDA case the exact form on MUFU ex2/rcp (2).
    assert {launch._tanh_mode(dtype, "cpu", backward=b, exact=e) for b in (False, True) for e in (False, True)} == {0}
    sixteen = dtype != torch.float32
    assert launch._tanh_mode(dtype, "cuda") == (1 if sixteen else 2)
    assert launch._tanh_mode(dtype, "cuda", backward=True) == (1 if dtype == torch.bfloat16 else 2)
    assert launch._tanh_mode(dtype, "cuda", exact=True) == 2
    assert launch._tanh_mode(dtype, "cuda", backward=True, exact=True) == 2


def test_gelu_chains_ask_the_backward_for_the_exact_tanh(monkeypatch):
    # The backward's plan: the approximate tanh would flip relu masks of a gelu chain (dW 1e-2 off
    # float64 in bf16 on the H100); planned as for a CUDA device by answering for its device type.
    from recfuse.chain import Chain
    seen = []
    real = launch._tanh_mode

    def as_on_cuda(dtype, device_type, backward=False, exact=False):
        seen.append((backward, exact))
        return real(dtype, "cuda", backward, exact)

    monkeypatch.setattr(launch, "_tanh_mode", as_on_cuda)
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    w = torch.randn(1, 16, dtype=torch.bfloat16)
    try:  # plans made for a CUDA device must not stay in the cache for the CPU tests after this one
        for chain in (Chain("layer_norm", "gelu", "relu"), Chain("layer_norm", "tanh", "relu")):
            launch._BACKWARD_PLANS.clear()
            plan = launch.backward_plan(torch.randn(2, 8, 1, dtype=torch.bfloat16), x, w, None, None, None, 1e-5,
                                        0, chain=chain)
            assert plan.meta["FAST_TANH"] == (2 if chain.activation == "gelu" else 1), plan.meta["FAST_TANH"]
    finally:
        launch._BACKWARD_PLANS.clear()
    assert (True, True) in seen and (True, False) in seen, seen


def test_the_direct_launch_is_on_only_for_the_runner_call_it_makes_itself():
    """`CompiledLaunchCache.bind` calls the compiled kernel's launcher the way Triton's runner does
    (`runner_call_is_known` reads the runner's source); a runner that passes its arguments otherwise
    keeps the launches."""
    from triton.compiler.compiler import CompiledKernel

    from recfuse.ops import _compiled_launch as cl

    import inspect
    source = inspect.getsource(CompiledKernel.__getitem__)
    assert cl.runner_call_is_known() == bool(cl._RUNNER_CALL.search(source))
    assert cl.runner_call_is_known()  # torch 2.13 / triton 3.x here, triton 3.6 on the GPU image
    reordered = source.replace("self.function, self.packed_metadata", "self.packed_metadata, self.function")
    assert cl._RUNNER_CALL.search(reordered) is None
    older = "self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, launch_metadata, " \
            "self.launch_enter_hook, self.launch_exit_hook, *args)"  # hooks from elsewhere: not this call
    assert cl._RUNNER_CALL.search(older) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bound_launch_passes_pointers_and_honours_triton_launch_hooks():
    """The bound forward launch (data pointers as integers, no hooks) writes what the JIT launch
    writes; with a launch hook registered with Triton, the launch goes through the runner and the
    hook sees it."""
    import triton

    from recfuse.ops import _compiled_launch as cl

    assert cl.runner_call_is_known()
    F, B, D, H = 4, 300, 64, 16
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(B, F * D, device="cuda", generator=g).view(B, F, D)
    w = torch.randn(H, D, device="cuda", generator=g) * D ** -0.5
    b = 0.1 * torch.randn(H, device="cuda", generator=g)
    lw = 1 + 0.1 * torch.randn(F, D, device="cuda", generator=g)
    lb = 0.1 * torch.randn(F, D, device="cuda", generator=g)
    launch._FORWARD_PLANS.clear()
    first = launch.forward(x, w, b, lw, lb, 1e-5, 1)  # the JIT launch, then bound
    plan = launch.forward_plan(x, w, b, lw, lb, 1e-5, 1)
    assert plan.bound is not None
    y, _ = plan(x, w, b, lw, lb)
    assert torch.equal(y, first)
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not cl.no_launch_hooks(triton.knobs.runtime)
        y_hooked, _ = plan(x, w, b, lw, lb)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert torch.equal(y_hooked, y) and len(seen) == 1, seen
    y64 = recfuse.reference.ln_tanh_linear_relu(x.double(), w.double(), b.double(), ln_weight=lw.double(),
                                                ln_bias=lb.double(), feature_dim=1)
    assert ((y.double() - y64).norm() / y64.norm()).item() < 1e-5


@triton.jit
def _two_tensor_kernel(A, B, n, m, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass  # never launched: its signature is what `bound_launch` lays out


def test_bound_launcher_argument_layout_and_hooks_without_a_gpu():
    """`CompiledLaunchCache.bound_launch` over a recording stand-in for a compiled kernel: the direct
    call passes the grid, the stream, the kernel's function and packed metadata, None for the
    launch metadata and both hooks, then the tensors' data pointers and every other argument in
    signature order (the layout the CUDA test checks by the kernel's output); with a Triton launch
    hook registered the call goes through the runner with the tensors themselves."""
    import triton

    from recfuse.ops import _compiled_launch as cl

    calls = []

    class Recording:
        function, packed_metadata = "fn", "packed"

        @staticmethod
        def run(*args):
            calls.append(("run", args))

        def __getitem__(self, grid):
            return lambda *args, stream=None: calls.append(("runner", grid, args, stream))

    cache = cl.CompiledLaunchCache(_two_tensor_kernel)
    a, b = torch.zeros(4), torch.ones(4)
    rest = (4, 3)  # n, m
    bound = cache.bound_launch(Recording(), (5, 2), (a, b) + rest, {"BLOCK": 8}, 2, 0, lambda index: 77, {})
    bound(a, b)
    kind, args = calls[-1]
    assert kind == "run" and args[:9] == (5, 2, 1, 77, "fn", "packed", None, None, None)
    # pointers, the runtime integers, then the constexprs (BLOCK given, FLAG its default)
    assert args[9:] == (a.data_ptr(), b.data_ptr(), 4, 3, 8, False)
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_exit_hook.add(hook)
    try:
        bound(a, b)
    finally:
        triton.knobs.runtime.launch_exit_hook.remove(hook)
    kind, grid, args, stream = calls[-1]
    assert kind == "runner" and grid == (5, 2, 1) and stream == 77
    assert args[0] is a and args[1] is b and args[2:] == (4, 3, 8, False)
