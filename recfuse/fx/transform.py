"""`transform`, `explain`, verification, and the torch.compile entry points of the graph pass."""
from __future__ import annotations

import collections
import contextlib
import copy
import gc
import logging
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn
from torch.fx import Graph, GraphModule
from torch.utils._pytree import tree_flatten

from ..errors import RecfuseError
from .capture import PendingModule, _StateSnapshot, capture, unshare
from .fuse import fuse_graph
from .graph_module import (_restore_dropped, mark_stacked_away, module_signature, original_order, plain_settings,
                           restore_order)
from .plan import attr_tensor
from .registry import FUSIONS, select_fusions
from .replay import CudaGraphReplayModule
from .report import FusionReport, NearMiss
from .values import VAL_KEY, annotate_from_meta

__all__ = ["transform", "explain", "verify", "fuse_graph", "RecfusePreGradPass", "pre_grad_pass",
           "make_backend", "backend"]

logger = logging.getLogger("recfuse")

# ---------------------------------------------------------------------------------------------
# parameters and state dicts


def _prune(gm: GraphModule, old_attrs: list) -> None:
    """Drop the per-slice parameters (and their modules) that the graph no longer uses."""
    gm.delete_all_unused_submodules()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for qual in old_attrs:
        if qual in used:
            continue
        owner_path, _, name = qual.rpartition(".")
        owner = _submodule_or_none(gm, owner_path) if owner_path else gm
        if owner is None:
            continue
        if hasattr(owner, name) and not any(u.startswith(qual + ".") for u in used):
            delattr(owner, name)


def _submodule_or_none(gm: nn.Module, path: str) -> Optional[nn.Module]:
    """``gm.get_submodule(path)``, or None where that raises AttributeError. Walks the `_modules`
    dicts: the owners of the per-slice parameters fusion pruned are gone, and get_submodule's
    AttributeError for each of 10,000 of them was a third of pruning them."""
    mod = gm
    for part in path.split("."):
        cls = type(mod)
        if part in mod.__dict__ or hasattr(cls, part) or cls.__getattr__ is not nn.Module.__getattr__:
            break  # getattr finds something before (or instead of) `_modules`: get_submodule says
        mod = mod._modules.get(part)
        if mod is None:
            return None  # a parameter, a buffer or nothing: get_submodule raises
    else:
        return mod
    try:
        return gm.get_submodule(path)
    except AttributeError:
        return None


def _adopt_original_state(gm: GraphModule, model: nn.Module, skip: frozenset = frozenset()) -> dict:
    """Make `gm` hold every parameter and buffer of `model` under its original name, with its
    persistence: the graph reads only some (GraphModule keeps those); the rest (a head used by
    another method, a step counter) are deep copies, tied to gm's tensors where the model's are.
    Tensor attributes that are not in the model's state_dict (plain tensor attributes, which
    GraphModule registers as buffers) are made non-persistent. Returns name -> (tensor,
    persistent) for every name, so that `_finish_module` can put back what fusion pruned. Names in
    `skip` (the per-slice tensors fusion stacked, when it runs after fusion) are left out."""
    entries = []  # (name, original tensor, persistent)
    for prefix, mod in model.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        for k, t in mod._parameters.items():
            if t is not None and (not skip or pre + k not in skip):
                entries.append((pre + k, t, True))
        for k, t in mod._buffers.items():
            if t is not None and (not skip or pre + k not in skip):
                entries.append((pre + k, t, k not in mod._non_persistent_buffers_set))
    memo: dict = {}
    present = {}
    for name, t, _ in entries:
        g = attr_tensor(gm, name)
        if g is not None:
            present[name] = g
            memo.setdefault(id(t), g)
    if len(present) < len(entries):
        _memo_shared_storage(entries, present, memo)
    kept = {}
    for name, t, persistent in entries:
        g = present.get(name)
        if g is None:
            fresh = id(t) not in memo
            shared = memo.get("torch", {}).get(t.untyped_storage()._cdata) if _plain(t) else None
            if fresh and shared is not None and type(t) is nn.Parameter:  # Parameter.__deepcopy__ would clone
                memo[id(t)] = nn.Parameter(torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    shared, t.storage_offset(), t.size(), t.stride()), t.requires_grad)
            g = copy.deepcopy(t, memo)
            if fresh:
                for hook in (getattr(t, "_backward_hooks", None) or {}).values():
                    g.register_hook(hook)
                for hook in (getattr(t, "_post_accumulate_grad_hooks", None) or {}).values():
                    g.register_post_accumulate_grad_hook(hook)
        _assign(gm, name, g, persistent)
        kept[name] = (g, persistent)
    names = set(kept)
    for prefix, mod in gm.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        for k in mod._buffers:
            if pre + k not in names:
                mod._non_persistent_buffers_set.add(k)
    return kept


def _memo_shared_storage(entries: list, present: dict, memo: dict) -> None:
    """Point deepcopy's storage memo at gm's storage of each tensor the graph reads. A tensor the
    graph does not read may share storage with one it reads (a buffer registered as
    `weight.detach()`): its copy then shares gm's storage, as in the model. Only the copies of
    tensors the graph does not read consult it, so it is built only when there are some (asking
    for the storage of 20,000 per-feature parameters took a tenth of a second)."""
    for name, t, _ in entries:
        g = present.get(name)
        if g is not None and _same_layout(g, t):
            memo.setdefault("torch", {}).setdefault(t.untyped_storage()._cdata, g.untyped_storage())


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter) and t.device.type != "meta"


def _same_layout(copy_: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether `copy_` sits in its storage as `t` sits in its own (a copy of the whole storage)."""
    return (_plain(copy_) and _plain(t) and copy_.untyped_storage().nbytes() == t.untyped_storage().nbytes()
            and copy_.storage_offset() == t.storage_offset() and copy_.stride() == t.stride()
            and copy_.dtype == t.dtype and copy_.device == t.device)


def _assign(gm: nn.Module, name: str, t: torch.Tensor, persistent: bool) -> None:
    *path, leaf = name.split(".")
    owner = gm
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = nn.Module()
            owner.add_module(part, child)
        owner = child
    if owner._parameters.get(leaf) is t or owner._buffers.get(leaf) is t:
        if not persistent:
            owner._non_persistent_buffers_set.add(leaf)
        return
    if isinstance(t, nn.Parameter):
        owner.register_parameter(leaf, t)
    else:
        owner.register_buffer(leaf, t, persistent=persistent)


def _stacked_olds(report: FusionReport) -> set:
    """The per-slice attributes that fusion stacked into new parameters (the graph reads none)."""
    return {k for g in report.groups for v in g.stacked_params.values() for k in v}


def _finish_module(gm: GraphModule, report: FusionReport, kept: Optional[dict] = None,
                   shared: Sequence[torch.Tensor] = (), absorbed: Optional[dict] = None) -> GraphModule:
    stacked = {}
    for g in report.groups:
        stacked.update(g.stacked_params)
    olds = {k for v in stacked.values() for k in v}
    _prune(gm, list(olds))
    if shared:
        # The original's tensors the trace shared: what fusion did not prune gets its own copy now.
        if kept:
            kept = {k: v for k, v in kept.items() if k not in olds}
        unshare(gm, shared, kept)
    for name, (t, persistent) in (kept or {}).items():
        if name not in olds and attr_tensor(gm, name) is not t:
            _assign(gm, name, t, persistent)  # not read by the fused graph, still the model's state
    if stacked:
        gm._recfuse_stacked = stacked
    if absorbed:
        gm._recfuse_absorbed = absorbed
    settings = getattr(gm, "_recfuse_settings", None) or getattr(gm, "_recfuse_inlined", None)
    if stacked or absorbed or settings:
        mark_stacked_away(gm)
    for n in gm.graph.nodes:
        n.meta.pop(VAL_KEY, None)
    gm.graph.lint()
    gm.recompile()
    return gm


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Capture and fusion allocate a few objects per graph node and free almost none until they
    end; meanwhile every full collection walks the whole heap, which grows with the model, so a
    10x larger model took 15x longer. Whatever cycles they leave are collected afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _run(model, example_inputs, fusions, stack_parameters: bool = True) -> tuple[GraphModule, FusionReport]:
    t0 = time.perf_counter()
    # Under the caller's inference_mode the stacked parameters and the copies the result owns would
    # be inference tensors: the result could not be trained, nor its state loaded. Make them
    # normal tensors; the grad mode the capture sees stays the caller's (off in inference_mode).
    grad = torch.is_grad_enabled()
    with _cyclic_gc_paused(), torch.inference_mode(False), torch.set_grad_enabled(grad):
        # _finish_module recompiles, and copies the original's tensors that the trace shared and the
        # result keeps (the per-feature ones fusion stacks are never copied)
        gm, facts = capture(model, example_inputs, codegen=False, share_leaves=True)
        # A PendingModule: fusion works on the traced copy and the graph, the GraphModule is built
        # after it (holding only what the fused graph reads).
        pending = isinstance(gm, PendingModule)
        kept = _adopt_original_state(gm, model) if isinstance(model, nn.Module) and not pending else None
        report = FusionReport(model=facts["name"], capture=facts["how"])
        absorbed = {}
        if not facts["shapes"]:
            report.reason = "no example_inputs: shapes are unknown, so slices cannot be matched"
            report.near_misses.append(NearMiss("model", report.reason))
        else:
            called = collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_module")
            fuse_graph(gm.graph, gm.root if pending else gm, stack_params_once=stack_parameters, report=report,
                       fusions=fusions,
                       alone=facts.get("alone") if pending else None)
            # the modules fusion stopped calling (some or all of their calls): hooks registered on them
            # later would never run (`guard_absorbed`)
            called.subtract(n.target for n in gm.graph.nodes if n.op == "call_module")
            root = gm.root if pending else gm
            absorbed = {k: module_signature(root.get_submodule(k)) for k in sorted(k for k, v in called.items() if v > 0)}
            if facts["constants"]:
                report.capture += " (constants: " + ", ".join(f"{k}={v!r}" for k, v in facts["constants"].items()) + ")"
        if pending:
            gm = gm.build(codegen=False)
            kept = _adopt_original_state(gm, model, skip=_stacked_olds(report))
        if isinstance(model, nn.Module):
            # plain attributes the traced forward may have read: constants of the graph now
            gm.__dict__["_recfuse_settings"] = plain_settings(model)
            # modules with a forward of their own, which the trace inlined (hooks on them would never run)
            # (torch.nn's own modules are leaves the graph calls, except containers it traces through)
            gm.__dict__["_recfuse_inlined"] = {
                k: module_signature(m) for k, m in model.named_modules(remove_duplicate=False)
                if k and type(m).forward is not nn.Module.forward
                and (not type(m).__module__.startswith("torch.nn") or isinstance(m, nn.Sequential))}
        gm = _finish_module(gm, report, kept, facts.get("shared", ()), absorbed)
        if isinstance(model, nn.Module):
            # parameters() in the original's order, not the forward's (`restore_order`)
            gm.__dict__["_recfuse_order"] = original_order(model)
            restore_order(gm)
        kept = None  # the per-slice copies fusion pruned are freed now, not walked by the collection that
        # turning the collector back on starts
    report.seconds = time.perf_counter() - t0
    return gm, report


def transform(model, example_inputs: Optional[tuple] = None, *, verify: bool = False,
              cuda_graph: bool = False, fusions: Optional[Sequence[str]] = None,
              stack_parameters: bool = True) -> nn.Module:
    """Rewrite a per-feature model into batched (horizontal) and fused (vertical) form.

    Per-slice chains ``split -> LayerNorm -> tanh [-> Linear -> relu] -> stack`` become one batched
    chain over a zero-copy 3D view of the source, and LayerNorm -> tanh -> Linear -> relu becomes
    one ``recfuse.ln_tanh_linear_relu`` node (any other [LayerNorm|RMSNorm] -> [activation] -> Linear ->
    [activation] chain: one ``recfuse.feature_mlp`` node). Per-feature parameters are stacked once into
    parameters of the result; a state_dict of the original model still loads into it. Build the
    optimizer from the *transformed* model's parameters.

    Args:
        model: an nn.Module or a plain function.
        example_inputs: a tuple of the model's arguments. Tensors (and dicts of tensors) are used to
            learn shapes; other entries (ints such as ``batch_size``, modules) become constants of
            the graph, and the result may be called with or without them.
        verify: run the original and the result on `example_inputs`, forward and backward, and
            raise `RecfuseError` with the largest difference if they disagree.
        cuda_graph: opt-in, for inference on fixed shapes: calls with CUDA tensors that need no
            autograd record replay captured CUDA graphs (one launch per call instead of the
            graph's Python and the op's host work). Inputs are read in place while their
            addresses repeat, results you still hold are never overwritten; the capture and
            re-capture rule is in `recfuse.cuda_graph`. Training calls run as usual.
        fusions: names of the fusions to run (default: every registered one, see
            `recfuse.fx.FUSIONS`); they are tried in registry order whatever the order here.
        stack_parameters: True (default): per-feature parameters are stacked once into new
            parameters of the result ([F, D] instead of F [D] ones). False: the result keeps the
            original parameters, names and shapes, and stacks them inside the graph on each call
            (a copy of F small tensors per call). Use False with optimizers or parameter groups
            that look at a parameter's shape: Adafactor factors a 2-D parameter's second moment,
            "no weight decay where p.ndim < 2" would decay the stacked LayerNorm rows, Muon takes
            2-D parameters only; the stacked result trains differently under them.

    Returns:
        A torch.fx GraphModule (the unchanged graph when nothing could be fused; see `explain`).

    Raises:
        RecfuseError: the model cannot be captured (e.g. data-dependent control flow), or
            ``verify=True`` found a difference.
        ValueError: `fusions` names a fusion that is not registered.

    Example:
        >>> import torch, recfuse
        >>> from recfuse.puzzler import split_stack
        >>> lin = torch.nn.Linear(8, 1)
        >>> x = torch.randn(4 * 3 * 8)
        >>> fused = recfuse.transform(split_stack, (x, 4, 8, lin))
        >>> torch.allclose(fused(x), split_stack(x, 4, 8, lin), atol=1e-5)
        True
    """
    if not isinstance(cuda_graph, bool):
        raise TypeError(f"cuda_graph must be a bool, got {cuda_graph!r}")
    if not isinstance(stack_parameters, bool):
        raise TypeError(f"stack_parameters must be a bool, got {stack_parameters!r}")
    select_fusions(fusions)  # an unknown name fails before the capture's cost
    gm, report = _run(model, example_inputs, fusions, stack_parameters)
    if cuda_graph:
        gm = _replaying(gm)
    logger.info(report.summary())
    gm.recfuse_report = report
    if verify:
        if example_inputs is None:
            raise RecfuseError("verify=True needs example_inputs")
        _verify_transform(model, gm, example_inputs)
    return gm


def _replaying(gm: GraphModule) -> GraphModule:
    """The same graph and parameters as a `CudaGraphReplayModule` (state_dict hooks carried over)."""
    replay = CudaGraphReplayModule(gm, gm.graph, class_name=type(gm).__name__)
    # GraphModule's constructor keeps only what the graph reads: without this the replaying
    # module lost the model's forward hooks (a hook that changed the output was silently
    # skipped: 2.4 off the original) and the state the graph does not read (unused parameters,
    # buffers: the original's state_dict no longer loaded). Deepcopy and torch.load restore
    # them the same way (red-team round 15).
    _restore_dropped(replay, gm.__dict__)
    stacked = getattr(gm, "_recfuse_stacked", None)
    absorbed = getattr(gm, "_recfuse_absorbed", None)
    if stacked:
        replay._recfuse_stacked = stacked
    if absorbed:
        replay._recfuse_absorbed = absorbed
    settings = getattr(gm, "_recfuse_settings", None)
    if settings:
        replay._recfuse_settings = settings
    inlined = getattr(gm, "_recfuse_inlined", None)
    if inlined:
        replay._recfuse_inlined = inlined
    order = gm.__dict__.get("_recfuse_order")
    if order:
        replay.__dict__["_recfuse_order"] = order
    settings = settings or inlined
    if stacked or absorbed or settings:
        mark_stacked_away(replay)
    restore_order(replay)
    return replay


def explain(model, example_inputs: Optional[tuple] = None, *,
            fusions: Optional[Sequence[str]] = None) -> FusionReport:
    """What `transform` would fuse, and why other candidates were left alone: for each group, the
    fusion that claimed it and the reasons of those that declined it (`fusions` as in `transform`).

    Example:
        >>> import torch, recfuse
        >>> from recfuse.puzzler import split_stack
        >>> r = recfuse.explain(split_stack, (torch.randn(96), 4, 8, torch.nn.Linear(8, 1)))
        >>> r.groups[0].ops, r.groups[0].fusion
        ('layer_norm -> tanh -> linear -> relu', 'vertical_ln_tanh_linear_relu')
        >>> r = recfuse.explain(split_stack, (torch.randn(96), 4, 8, torch.nn.Linear(8, 1)),
        ...                     fusions=["horizontal_chain"])
        >>> r.groups[0].fusion, r.disabled
        ('horizontal_chain', ['vertical_ln_tanh_linear_relu', 'vertical_feature_mlp'])
    """
    select_fusions(fusions)
    return _run(model, example_inputs, fusions)[1]


# ---------------------------------------------------------------------------------------------
# verification


def _grad_leaves(v):
    if isinstance(v, torch.Tensor):
        t = v.detach().clone()
        if t.is_floating_point():
            t.requires_grad_(True)
        return t
    if isinstance(v, dict):
        return {k: _grad_leaves(x) for k, x in v.items()}
    if type(v) in (list, tuple):
        return type(v)(_grad_leaves(x) for x in v)
    return v


def _named_params(model, example_inputs) -> dict:
    if isinstance(model, nn.Module):
        return dict(model.named_parameters())
    import inspect

    names = list(inspect.signature(model).parameters)
    out = {}
    for name, v in zip(names, example_inputs):
        if isinstance(v, nn.Module):
            out.update({f"{name}.{k}": p for k, p in v.named_parameters()})
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[float, bool]:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf"), False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return float("nan"), False
    a, b = a[~nan_a], b[~nan_b]
    if a.numel() == 0:
        return 0.0, True
    d = (a - b).abs()
    ok = bool((d <= atol + rtol * b.abs()).all()) or float((a - b).norm() / b.norm().clamp_min(1e-30)) < rtol
    return float(d.max()), ok


def verify(model, transformed: nn.Module, example_inputs: tuple, *, rtol: float = 1e-4, atol: float = 1e-5) -> float:
    """Run `model` and `transformed` on `example_inputs`, forward and backward; raise on mismatch.

    Compares outputs, gradients of floating inputs, and parameter gradients (stacked parameters
    row by row against the per-slice originals). Uses `torch.autograd.grad`, so no ``.grad``
    field is touched. Returns the largest absolute difference seen.

    Raises:
        RecfuseError: naming the tensor with the largest difference beyond tolerance.

    Example:
        >>> import torch, recfuse
        >>> from recfuse.puzzler import split_stack
        >>> args = (torch.randn(96), 4, 8, torch.nn.Linear(8, 1))
        >>> recfuse.fx.verify(split_stack, recfuse.transform(split_stack, args), args) < 1e-4
        True
    """
    example_inputs = tuple(example_inputs)
    # Both run from the same RNG state (dropout draws the same masks) and leave no trace in
    # either model's buffers (BatchNorm statistics) or in the caller's RNG stream.
    holder = nn.ModuleList([m for m in (model, transformed, *example_inputs) if isinstance(m, nn.Module)])
    with _StateSnapshot(holder, example_inputs):
        return _verify(model, transformed, example_inputs, rtol, atol)


_verify_transform = verify  # `transform`'s own `verify` argument shadows the function's name


def _verify(model, transformed, example_inputs, rtol, atol) -> float:
    in_a = tuple(_grad_leaves(v) for v in example_inputs)
    in_b = tuple(_grad_leaves(v) for v in example_inputs)
    seed = int(torch.randint(0, 2**31 - 1, ()))
    torch.manual_seed(seed)
    out_a = model(*in_a)
    torch.manual_seed(seed)
    out_b = transformed(*in_b)
    fa, _ = tree_flatten(out_a)
    fb, _ = tree_flatten(out_b)
    if len(fa) != len(fb):
        raise RecfuseError(f"verify: the transformed model returns {len(fb)} values, the original {len(fa)}")
    worst = (0.0, "")
    failures = []

    def check(name, a, b):
        nonlocal worst
        d, ok = _max_diff(a, b, rtol, atol)
        if not ok:
            failures.append((d, name))
        if d == d and d > worst[0]:
            worst = (d, name)

    gen = torch.Generator().manual_seed(0)
    pairs = [(a, b) for a, b in zip(fa, fb) if isinstance(a, torch.Tensor)]
    for k, (a, b) in enumerate(pairs):
        check(f"output {k}", a, b)
    diff_pairs = [(a, b) for a, b in pairs if a.requires_grad and b.requires_grad]
    if diff_pairs:
        cot = [torch.randn(a.shape, generator=gen, dtype=torch.float64).to(a.dtype) for a, _ in diff_pairs]
        leaves_a = [t for t in tree_flatten(in_a)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        leaves_b = [t for t in tree_flatten(in_b)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        # Trainable parameters only: autograd.grad raises "One of the differentiated Tensors does not
        # require grad" for a frozen one, so verify=True failed on any model with a frozen parameter
        # (red-team round 15). A frozen parameter has no gradient to compare.
        all_a, all_b = _named_params(model, example_inputs), dict(transformed.named_parameters())
        pa = {k: p for k, p in all_a.items() if p.requires_grad}
        pb = {k: p for k, p in all_b.items() if p.requires_grad}
        stacked = getattr(transformed, "_recfuse_stacked", {})
        for n, p in all_b.items():  # so the filter cannot hide a frozen parameter made trainable
            rows = [all_a[o] for o in stacked.get(n, (n,)) if o in all_a]
            if any(r.requires_grad != p.requires_grad for r in rows):
                failures.append((float("nan"), f"requires_grad of {n} ({p.requires_grad}; the original's: "
                                               f"{[r.requires_grad for r in rows]})"))
        names_b = [n for n in pb if n in stacked or n in pa]
        ga = torch.autograd.grad([a for a, _ in diff_pairs], leaves_a + list(pa.values()), cot, allow_unused=True)
        gb = torch.autograd.grad([b for _, b in diff_pairs], leaves_b + [pb[n] for n in names_b], cot, allow_unused=True)
        n_in = len(leaves_a)
        for k in range(n_in):
            if ga[k] is not None and gb[k] is not None:
                check(f"gradient of input {k}", ga[k], gb[k])
        grads_a = dict(zip(pa, ga[n_in:]))
        for n, g in zip(names_b, gb[n_in:]):
            if n in stacked:
                rows = [grads_a.get(o) for o in stacked[n]]
                if g is None or any(r is None for r in rows):
                    continue
                check(f"gradient of {n} (stacked from {stacked[n][0]}, ...)", torch.stack(rows), g)
            elif grads_a.get(n) is not None and g is not None:
                check(f"gradient of {n}", grads_a[n], g)
    if failures:
        d, name = max(failures, key=lambda x: (x[0] != x[0], x[0]))
        raise RecfuseError(
            f"verify failed: the transformed model differs from the original; largest difference {d:.3g} "
            f"in {name} (rtol={rtol}, atol={atol}); {len(failures)} tensor(s) out of tolerance")
    logger.info("recfuse: verify passed (largest difference %.3g in %s)", worst[0], worst[1] or "-")
    return worst[0]


# ---------------------------------------------------------------------------------------------
# torch.compile


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _CustomGraphPass
except Exception:  # older torch: a plain callable is accepted too
    _CustomGraphPass = object


class RecfusePreGradPass(_CustomGraphPass):
    """The pass as an Inductor pre-grad custom pass: ``config.pre_grad_custom_pass`` calls it with
    the Dynamo graph (parameters are graph inputs there, so per-slice ones are stacked in the graph,
    once per call; Inductor fuses that copy into its kernels).

    Example:
        >>> import torch, recfuse.fx
        >>> from torch._inductor import config
        >>> config.pre_grad_custom_pass = recfuse.fx.pre_grad_pass   # doctest: +SKIP
        >>> fast = torch.compile(model)                                # doctest: +SKIP
    """

    def __init__(self):
        self.last_report: Optional[FusionReport] = None

    def __call__(self, graph: Graph) -> None:
        annotate_from_meta(graph)
        report = fuse_graph(graph, graph.owning_module, stack_params_once=False,
                            report=FusionReport(model="torch.compile graph", capture="dynamo"))
        for n in graph.nodes:
            n.meta.pop(VAL_KEY, None)
        self.last_report = report
        logger.info(report.summary())

    def uuid(self) -> Any:
        from ..import __version__

        return f"recfuse-pre-grad-{__version__}-" + "-".join(f.name for f in FUSIONS)


pre_grad_pass = RecfusePreGradPass()


def make_backend(inner: Any = "inductor"):
    """A torch.compile backend that runs the recfuse pass, then `inner` ('inductor', 'eager' or a
    backend callable).

    Example:
        >>> import torch, recfuse.fx
        >>> from recfuse.puzzler import SplitStack
        >>> m = torch.compile(SplitStack(8), backend=recfuse.fx.make_backend("eager"))
        >>> m(torch.randn(4 * 3 * 8), 4, 8).shape
        torch.Size([3, 4, 1])
    """

    def recfuse_backend(gm: GraphModule, example_inputs, **kwargs):
        if not annotate_from_meta(gm.graph):
            from torch.fx.passes.shape_prop import ShapeProp

            ShapeProp(gm).propagate(*example_inputs)
            annotate_from_meta(gm.graph)
        report = fuse_graph(gm.graph, gm, stack_params_once=False,
                            report=FusionReport(model="torch.compile graph", capture="dynamo"))
        logger.info(report.summary())
        for n in gm.graph.nodes:
            n.meta.pop(VAL_KEY, None)
        gm.recompile()
        recfuse_backend.last_report = report
        if inner == "eager":
            return gm.forward
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return inner(gm, example_inputs, **kwargs)

    recfuse_backend.last_report = None
    return recfuse_backend


backend = make_backend("inductor")
backend.__doc__ = """torch.compile backend: the recfuse pass, then Inductor.

Example:
    >>> import torch, recfuse.fx
    >>> fast = torch.compile(model, backend=recfuse.fx.backend)   # doctest: +SKIP
"""
