"""`TransformedGraphModule`: the GraphModule `recfuse.transform` returns, which keeps what makes it
recfuse's through state_dict loads, `copy.deepcopy`, and `torch.save` / `torch.load`.

A plain GraphModule forgets, on deepcopy and on unpickling, every attribute its graph does not
read and every state-dict hook (a hook bound to the module keeps pointing at the *old* module).
The mapping from the original model's state-dict keys to the stacked parameters is therefore a
method of this class, not a hook, and `__deepcopy__` / `__reduce__` carry the recfuse attributes.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import json
import logging
import re
import sys
import traceback
import types
import weakref
from typing import Any, Optional

import torch
from torch.fx import GraphModule
from torch.fx.graph_module import _WrappedCall, reduce_graph_module
from torch.fx import _symbolic_trace as _fx_symbolic_trace
from torch.nn.modules import module as _nn_module

log = logging.getLogger("recfuse")

__all__ = ["TransformedGraphModule", "map_original_keys", "carry_state", "mark_stacked_away"]

# Attributes that are recfuse's own and must survive deepcopy and pickling.
PRESERVED_ATTRS = ("_recfuse_stacked", "_recfuse_absorbed", "_recfuse_settings", "_recfuse_inlined", "recfuse_report",
                   "_recfuse_order")
# Attributes that are caches of one process (CUDA graphs, tensor readers): dropped by pickling.
TRANSIENT_ATTRS = ("_cuda_graph_cache", "_module_tensors", "_tracer_extras")
# The model's forward hooks (carried to the result by capture); GraphModule.__init__ resets them.
HOOK_ATTRS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")


def carry_state(dst: torch.nn.Module, src) -> None:
    """Give `dst` every parameter, buffer and submodule of `src` (a module, or anything with its
    `_parameters`, `_buffers`, `_non_persistent_buffers_set` and `_modules`) that it lacks, and
    the persistence of src's buffers. GraphModule's constructor keeps only what the graph reads;
    a transformed model keeps the original's whole state (parameters the forward never reads
    included), so that its state_dict loads strictly and the optimizer sees the same parameters.

    Example:
        >>> src = torch.nn.Module(); src.a = torch.nn.Linear(2, 2); src.register_buffer("s", torch.zeros(()))
        >>> dst = torch.nn.Module(); carry_state(dst, src); sorted(dst.state_dict())
        ['a.bias', 'a.weight', 's']
    """
    nonpersistent = getattr(src, "_non_persistent_buffers_set", set())
    for k, t in src._parameters.items():
        if t is not None and k not in dst._parameters and k not in dst._buffers and k not in dst._modules:
            dst.register_parameter(k, t)
    for k, t in src._buffers.items():
        if t is None:
            continue
        if k not in dst._buffers and k not in dst._parameters and k not in dst._modules:
            dst.register_buffer(k, t, persistent=k not in nonpersistent)
        elif k in dst._buffers and k in nonpersistent:
            dst._non_persistent_buffers_set.add(k)
    for k, m in src._modules.items():
        if m is None:
            continue
        d = dst._modules.get(k)
        if d is None:
            if k not in dst._parameters and k not in dst._buffers:
                dst.add_module(k, m)
        elif d is not m:
            carry_state(d, m)


def original_order(model: torch.nn.Module) -> dict:
    """{full name: rank} of every submodule, parameter and buffer of `model`, in the order of
    ``named_modules()`` and each module's own parameters and buffers: what `restore_order` makes a
    transformed model's order follow."""
    ranks = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        pre = path + "." if path else ""
        ranks.setdefault(path, len(ranks))
        for k in list(mod._parameters) + list(mod._buffers):
            ranks.setdefault(pre + k, len(ranks))
    return ranks


def restore_order(gm: torch.nn.Module) -> None:
    """Order the submodules, parameters and buffers of `gm` (a transformed model) as the original
    model's (`gm._recfuse_order`, from `original_order`); the parameters fusion stacked come after
    the root's own, ordered by their first original row. GraphModule registers what its graph reads
    in the order the graph reads it (the forward's order), so ``parameters()`` came in another order
    than the original's wherever the forward used its modules in another order than ``__init__``
    made them (an item tower run before the user tower, a dict input in another key order), and an
    optimizer state_dict of the original (which has no names and loads by position) gave each
    parameter another's moments, silently where the shapes agreed (red-team round 19). The order
    also does not depend on which example the transform saw, nor on how its groups were numbered."""
    ranks = gm.__dict__.get("_recfuse_order")
    if not ranks:
        return
    stacked = gm.__dict__.get("_recfuse_stacked") or {}
    last = len(ranks)

    def rank(full: str) -> int:
        r = ranks.get(full)
        if r is None and full in stacked:
            r = last + min((ranks.get(o, last) for o in stacked[full]), default=last)
        return 2 * last + 1 if r is None else r

    seen = set()
    todo = [("", gm)]
    while todo:
        path, mod = todo.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        pre = path + "." if path else ""
        for attr in ("_modules", "_parameters", "_buffers"):
            d = mod.__dict__.get(attr)
            if not isinstance(d, dict) or len(d) < 2:
                continue
            items = sorted(dict.items(d), key=lambda kv: rank(pre + kv[0]))
            if [k for k, _ in items] != list(dict.keys(d)):
                dict.clear(d)
                dict.update(d, items)
        todo.extend((pre + k, m) for k, m in reversed(list(mod._modules.items())) if m is not None)


def map_original_keys(module: torch.nn.Module, state_dict: dict, prefix: str, missing_keys: list,
                      error_msgs: Optional[list] = None) -> None:
    """Rewrite a state_dict of the original model (``lns.3.weight``) onto the stacked parameters of
    `module` (``recfuse_g0_ln_weight`` row 3), in place.

    Example:
        >>> import torch, recfuse
        >>> m = torch.nn.Module(); m.p = torch.nn.Parameter(torch.zeros(2, 3))
        >>> m._recfuse_stacked = {"p": ["a.weight", "b.weight"]}
        >>> sd = {"a.weight": torch.ones(3), "b.weight": torch.full((3,), 2.0)}
        >>> map_original_keys(m, sd, "", []); sd["p"][:, 0].tolist()
        [1.0, 2.0]
    """
    for new, olds in getattr(module, "_recfuse_stacked", {}).items():
        keys = [prefix + k for k in olds]
        if not any(k in state_dict for k in keys):
            continue
        cur = getattr(module, new).detach().clone()
        for i, k in enumerate(keys):
            if k in state_dict:
                value = state_dict.pop(k)
                if isinstance(value, torch.Tensor) and value.shape != cur[i].shape:
                    # As nn.Module's own load reports it for the original model. `cur[i] = value`
                    # raised a bare "expanded size" RuntimeError for a checkpoint of another D, and
                    # silently broadcast a scalar or [1] tensor over the row (red-team round 15).
                    if error_msgs is not None:
                        error_msgs.append(
                            f"size mismatch for {k}: copying a param with shape {value.shape} from checkpoint, the "
                            f"shape in current model is {cur[i].shape} (row {i} of `{prefix + new}`, which "
                            f"recfuse.transform stacked).")
                    continue
                cur[i] = value
            else:
                missing_keys.append(k)
        state_dict[prefix + new] = cur


def unstack_saved_rows(module: torch.nn.Module, state_dict: dict, prefix: str, saved: Optional[dict]) -> None:
    """Split the stacked parameters of a transformed model's state_dict into its original keys, in
    place, where the saver (`saved`: its `stacked_parameters()`, kept in the state_dict's metadata)
    stacked other rows under a name than `module` does; `map_original_keys` then puts each row
    where `module` holds that original parameter. Another transform of the same model may stack
    the features in another order (a dict input whose keys came in another order, a sharded EBC's
    KeyedTensor, the model's feature list reordered) or number its groups otherwise: loaded by
    position, every feature got another's weights, silently (red-team round 17).

    Example:
        >>> import torch
        >>> m = torch.nn.Module(); m.p = torch.nn.Parameter(torch.zeros(2, 1))
        >>> m._recfuse_stacked = {"p": ["b.weight", "a.weight"]}
        >>> sd = {"p": torch.tensor([[1.0], [2.0]])}
        >>> unstack_saved_rows(m, sd, "", {"p": ["a.weight", "b.weight"]}); sorted(sd)
        ['a.weight', 'b.weight']
        >>> map_original_keys(m, sd, "", []); sd["p"].flatten().tolist()
        [2.0, 1.0]
    """
    if not isinstance(saved, dict):
        return
    from . import optim_state

    mine = getattr(module, "_recfuse_stacked", {})
    for new, olds in saved.items():
        key = prefix + new
        value = state_dict.get(key)
        if (not isinstance(value, torch.Tensor) or not isinstance(olds, (list, tuple)) or value.dim() == 0
                or value.shape[0] != len(olds)):
            continue
        reordered = list(mine.get(new, ())) != list(olds)
        if new in mine:
            optim_state.note_loaded_rows(module, new, olds, reordered)
        if not reordered:
            continue
        del state_dict[key]
        for i, old in enumerate(olds):
            state_dict[prefix + old] = value[i]
        if new in mine:
            # The model's rows are right now; an optimizer's state of this parameter, saved beside
            # this checkpoint, has no names and loads by position: its first step maps it by the
            # rows recfuse recorded in its param_groups, or refuses it (`optim_state`).
            log.warning("recfuse: %s%s was saved with its rows stacked in another order (%s) than this "
                        "transform stacks them (%s); the rows are loaded by name. An optimizer "
                        "state_dict saved with that checkpoint loads by position: its first step puts "
                        "the rows back under their features (by the record recfuse keeps in its "
                        "param_groups), or refuses a state without that record.", prefix, new,
                        ", ".join(olds), ", ".join(mine[new]))


EXTRA_STATE_KEY = "_extra_state"
_EXTRA_STATE_TAG = "recfuse_stacked"


def encode_stacked(stacked: dict) -> torch.Tensor:
    """`stacked_parameters()` as UTF-8 JSON in a uint8 tensor (a transformed model's state_dict entry
    ``_extra_state``): a tensor, so that tensor-only formats (safetensors) and copies that drop the
    state_dict's ``_metadata`` keep it (as `FusedFeatureProcessor` keeps its feature names).

    Example:
        >>> decode_stacked(encode_stacked({"p": ["a.weight", "b.weight"]}))
        {'p': ['a.weight', 'b.weight']}
    """
    text = json.dumps({_EXTRA_STATE_TAG: {k: list(v) for k, v in stacked.items()}}, sort_keys=True)
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def decode_stacked(value) -> Optional[dict]:
    """The `stacked_parameters()` record `encode_stacked` wrote, or None for anything else (another
    module's extra state, a tensor of other bytes)."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        return None
    try:
        record = json.loads(bytes(value.tolist()).decode())
    except (ValueError, UnicodeDecodeError):
        return None
    stacked = record.get(_EXTRA_STATE_TAG) if isinstance(record, dict) else None
    if not isinstance(stacked, dict) or not all(
            isinstance(v, list) and all(isinstance(o, str) for o in v) for v in stacked.values()):
        return None
    return stacked


class _StackedAwayNames(dict):
    """The `_buffers` of a module (of the result) some of whose original tensors fusion stacked into
    a parameter of the result: `away` maps each such name to the message saying where it went.
    ``name in d`` is True for them (value None), so that torch.func.functional_call (and
    ``module.weight = t``) set them here, and that set raises: without it functional_call set a
    plain attribute that the fused graph never reads, or failed on a module path that fusion had
    pruned ("M has no attribute `ns`"), and the call ran with the stacked parameter silently."""

    away: dict = {}  # the class default: unpickling sets the items before the instance's __dict__

    def __contains__(self, k):
        return dict.__contains__(self, k) or k in self.away

    def __getitem__(self, k):
        if k in self.away and not dict.__contains__(self, k):
            return None
        return dict.__getitem__(self, k)

    def __setitem__(self, k, v):
        if k in self.away and not dict.__contains__(self, k):
            if v is None:
                return  # functional_call putting back the None it read
            from ..errors import RecfuseError

            raise RecfuseError(self.away[k])
        dict.__setitem__(self, k, v)

    def __delitem__(self, k):
        if k in self.away and not dict.__contains__(self, k):
            return
        dict.__delitem__(self, k)


# A module's plain settings that its Linear-like forward reads from its tensors' shapes at each call:
# a replacement may differ in them.
_SHAPE_SETTINGS = frozenset({"in_features", "out_features"})


def module_signature(mod: torch.nn.Module) -> tuple:
    """What a module that replaces `mod` must share with it for the fused graph (which reads only
    its tensors) to compute what it would: its class and its plain settings (eps, p, ...)."""
    t = type(mod)
    settings = tuple(sorted((k, v) for k, v in mod.__dict__.items()
                            if not k.startswith("_") and k != "training" and k not in _SHAPE_SETTINGS
                            and isinstance(v, (bool, int, float, str, tuple, type(None)))))
    return (f"{t.__module__}.{t.__qualname__}", settings)


def check_replacement(owner: torch.nn.Module, name: str, value) -> None:
    """Refuse ``owner.name = value`` where `name` is a module whose calls fusion replaced and
    `value` a module the fused graph could not stand for (another class, other settings, hooks)."""
    children = owner.__dict__.get("_recfuse_children")
    if (not children or name not in children or not isinstance(value, torch.nn.Module)
            or isinstance(value, (_FusedAway, _TracedHolder)) or type(value) is torch.nn.Module):
        return  # recfuse's (or torch.fx's) own holders, put back by deepcopy / torch.load
    path, signature = children[name]
    if (module_signature(value) != signature
            or any(value.__dict__.get(k) for k in _GUARDED_HOOK_DICTS + ("_forward_hooks_with_kwargs",))):
        from ..errors import RecfuseError

        raise RecfuseError(
            f"cannot replace `{path}` with this {type(value).__name__}: recfuse.transform fused the calls of the "
            f"original {signature[0].rpartition('.')[2]}{' ' + str(dict(signature[1])) if signature[1] else ''} into "
            "the transformed model's graph, "
            "which reads only the parameters of the module at this path. A module of the same class and "
            "settings without hooks may replace it (its parameters are read); for any other, replace it in "
            "the original model before recfuse.transform.")


def _refuse_hooks_of_replacement(owner: torch.nn.Module, name: str, value) -> None:
    """A module that replaced one whose calls fusion replaced (`check_replacement` let it) refuses
    hooks as that one did."""
    children = owner.__dict__.get("_recfuse_children")
    if children and name in children and isinstance(value, torch.nn.Module):
        _refuse_hooks(value, children[name][0])


class _ChecksReplacements:
    """Mixin of the modules that own a module whose calls fusion replaced (the transformed model,
    `_FusedHolder`): ``owner.name = module`` and ``add_module`` go through `check_replacement`, and
    an accepted replacement refuses hooks as the module it replaced did."""

    def __setattr__(self, name, value):
        check_replacement(self, name, value)
        _check_traced_setting(self, name, value)
        super().__setattr__(name, value)
        _refuse_hooks_of_replacement(self, name, value)

    def add_module(self, name, module):
        check_replacement(self, name, module)
        super().add_module(name, module)
        _refuse_hooks_of_replacement(self, name, module)

    def register_parameter(self, name, param):
        # ``owner.weight = nn.Parameter(...)`` comes here (a plain tensor goes to `_StackedAwayNames`,
        # which raises naming the stacked parameter and row). For a name fusion stacked away,
        # nn.Module's own check found the name "present" and raised an unexplained KeyError
        # "attribute 'weight' already exists" (red-team round 15).
        buffers = self.__dict__.get("_buffers")
        if (isinstance(buffers, _StackedAwayNames) and name in buffers.away
                and not dict.__contains__(buffers, name) and name not in self._parameters):
            from ..errors import RecfuseError

            raise RecfuseError(buffers.away[name])
        path = self.__dict__.get("_recfuse_path")
        base = name[:-len("_orig")] if name.endswith("_orig") else None
        if (path is not None and base and name not in self._parameters
                and (base in self._parameters or (isinstance(buffers, _StackedAwayNames) and base in buffers.away))):
            from ..errors import RecfuseError

            # torch.nn.utils.prune (and the old spectral_norm) move `weight` to `weight_orig` and
            # recompute `weight` in a forward pre-hook; here it failed half-way with an unexplained
            # KeyError ('weight', "attribute 'weight' already exists") or left the holder changed
            raise RecfuseError(
                f"cannot reparametrize `{path}.{base}` (torch.nn.utils.prune, spectral_norm): recfuse.transform "
                "fused the module that stood here into its graph, which reads its parameters directly and never "
                "calls the module, so a pruning hook would never run. Prune the original model before "
                "recfuse.transform (a pruned module is left unfused).")
        super().register_parameter(name, param)


def plain_settings(model: torch.nn.Module) -> dict:
    """{module path: {name: value}} of the plain (not tensor, not module) public attributes of
    `model` and its submodules (``self.temperature = 2.0``, ``self.use_residual = True``): what a
    traced forward reads as constants."""
    out = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        names = {k: (v if isinstance(v, _SIMPLE) else _Opaque(repr(v)[:80])) for k, v in vars(mod).items()
                 if not k.startswith("_") and k != "training" and not isinstance(v, (torch.Tensor, torch.nn.Module))}
        if names:
            out[path] = names
    return out


_SIMPLE = (bool, int, float, str, type(None))
_GRAPH_MODULE_OWN = ("meta", "shape_env", "code", "graph")


class _Opaque(str):
    """The repr of a setting that is not a plain number / str / bool / None (kept as its repr, so
    that saving the transformed model pickles no user object): any new value is refused."""


def _check_traced_setting(mod: torch.nn.Module, name: str, value) -> None:
    """Refuse ``mod.name = value`` where `name` was a plain attribute of the original module that
    stood here and whose forward was traced into the graph: the graph holds the value it had at
    transform time and would silently ignore the new one."""
    settings = mod.__dict__.get("_recfuse_traced_settings")
    if not settings or name not in settings:
        return
    old = settings[name]
    try:
        same = not isinstance(old, _Opaque) and type(value) is type(old) and bool(value == old)
    except Exception:
        same = False
    if same:
        return
    from ..errors import RecfuseError

    path = mod.__dict__.get("_recfuse_settings_path") or "the transformed model"
    where = f"`{path}.{name}`" if path != "the transformed model" else f"`{name}` of the transformed model"
    raise RecfuseError(
        f"cannot set {where} = {value!r}: recfuse.transform traced the original module's forward with "
        f"{name}={old!r}, and its graph keeps that value (a plain attribute is a constant of the traced code), "
        "so the new value would be silently ignored. Set it on the original model and transform again.")


class _TracedHolder(_ChecksReplacements, torch.nn.Module):
    """Stands (as torch.fx's plain holder did) at the path of a module whose forward was traced
    into the graph and that had plain settings: setting one of them is refused
    (`_check_traced_setting`)."""


def guard_settings(gm: torch.nn.Module) -> None:
    """Make the transformed model and the holders at the paths of traced modules refuse a new
    value for a plain attribute the original module had (`gm._recfuse_settings`), which the
    traced graph holds as a constant."""
    for path, names in (gm.__dict__.get("_recfuse_settings") or {}).items():
        try:
            mod = gm.get_submodule(path) if path else gm
        except AttributeError:
            continue
        if mod is not gm:
            if type(mod) is torch.nn.Module:
                mod.__class__ = _TracedHolder
            elif not isinstance(mod, _ChecksReplacements):
                continue  # a module kept as itself (a leaf the graph calls): it reads its settings
        # what the module class or the GraphModule machinery itself defines is not the original's setting
        names = {k: v for k, v in names.items()
                 if not hasattr(type(mod), k) and k not in _GRAPH_MODULE_OWN and not k.startswith("recfuse_")}
        mod.__dict__["_recfuse_traced_settings"] = names
        mod.__dict__["_recfuse_settings_path"] = path
    for path, signature in (gm.__dict__.get("_recfuse_inlined") or {}).items():
        try:
            mod = gm.get_submodule(path)
        except AttributeError:
            continue
        if type(mod) is torch.nn.Module:
            mod.__class__ = _TracedHolder
        if type(mod) is _TracedHolder:  # not a module the graph calls (a leaf kept as itself)
            # its owner refuses a replacement of another class or settings (whose forward the graph
            # would ignore), as for a module whose calls fusion replaced
            parent_path, _, leaf = path.rpartition(".")
            owner = gm.get_submodule(parent_path) if parent_path else gm
            if type(owner) is torch.nn.Module:
                owner.__class__ = _TracedHolder
            if isinstance(owner, _ChecksReplacements):
                owner.__dict__.setdefault("_recfuse_children", {}).setdefault(leaf, (path, signature))
            _refuse_hooks(mod, path, (
                f"cannot register a hook on `{path}`: recfuse.transform traced this module's forward into "
                "the transformed model's graph (the module here only holds its tensors), so it is never "
                "called and the hook would never run. Register it on the original model before "
                "recfuse.transform, or on the transformed model itself."))


class _FusedHolder(_ChecksReplacements, torch.nn.Module):
    """Stands at the path of a module whose calls fusion replaced: it holds the tensors that the
    fused graph reads from it (``lin.weight``) and nothing else. Setting a plain attribute on it
    (``ln.eps = 0.1``, ``drop.p = 0.5``) is refused: the fused graph holds the original module's
    value and would silently ignore the new one. Tensors, modules, None, ``training`` and private
    attributes are set as on any module. (Also the holder of such modules, which checks their
    replacements, `check_replacement`.)"""

    def __setattr__(self, name, value):
        path = self.__dict__.get("_recfuse_path")
        if path is not None and name == "qconfig":
            _refuse_quantization(path)
        if path is not None and not (name.startswith("_") or name == "training" or value is None
                                     or isinstance(value, (torch.Tensor, torch.nn.Module))):
            from ..errors import RecfuseError

            raise RecfuseError(
                f"cannot set `{path}.{name}` = {value!r}: recfuse.transform fused the module that stood here "
                "into its graph, which keeps the original module's settings and would ignore the new "
                "value. Set it on the original model before recfuse.transform.")
        super().__setattr__(name, value)

    @property
    def reset_parameters(self):
        # only where the fused module's class has one (`_fused_reset`): hasattr() is False elsewhere.
        # (A descriptor, not __getattr__: `read_attr`'s fast path needs nn.Module's __getattr__.)
        reset = _fused_reset(self)
        if reset is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute 'reset_parameters'")
        return reset

    def requires_grad_(self, requires_grad: bool = True):
        """nn.Module's, and also for the rows of stacked parameters that stand for tensors of
        modules at or below this holder's path. ``model.lns.requires_grad_(False)`` (freezing the
        fused LayerNorms) otherwise met a holder without those tensors and left the stacked
        LayerNorm parameters training, silently (red-team round 21). Some rows of a stacked
        parameter but not all: refused (they cannot be frozen one by one)."""
        found = _stacked_rows_under(self)
        if found is not None:
            gm, prefix = found
            changes = []
            for new, olds in getattr(gm, "_recfuse_stacked", {}).items():
                stacked = gm._parameters.get(new)
                if not isinstance(stacked, torch.nn.Parameter):
                    continue
                mine = [o for o in olds if not prefix or o.startswith(prefix + ".")]
                if not mine or stacked.requires_grad == requires_grad:
                    continue
                if len(mine) != len(olds):
                    from ..errors import RecfuseError

                    raise RecfuseError(
                        f"`{prefix}.requires_grad_({requires_grad})` would set requires_grad of "
                        f"{', '.join(f'`{o}`' for o in mine)} but not of the other rows of `{new}` (recfuse.transform "
                        "stacked them into one parameter, whose rows cannot be frozen one by one). Freeze them in "
                        "the original model and transform it (a frozen feature stays frozen), or transform with "
                        "stack_parameters=False.")
                changes.append(stacked)
            for stacked in changes:
                stacked.requires_grad_(requires_grad)
        return torch.nn.Module.requires_grad_(self, requires_grad)

    def extra_repr(self) -> str:
        return "holds what the fused graph reads"


def _refuse_quantization(path: str) -> None:
    """torch.ao.quantization (eager ``quantize_dynamic`` / ``prepare``, which set ``qconfig`` on every
    module, or FX ``prepare_fx``, which traces the graph) met a module whose calls fusion replaced:
    it would leave it in float, the rest quantized (red-team round 24)."""
    from ..errors import RecfuseError

    raise RecfuseError(
        f"cannot quantize `{path}`: recfuse.transform fused its calls into one recfuse op of the transformed "
        "model, whose parameters torch.ao.quantization does not rewrite, so it would stay in float while the "
        "rest of the model is quantized. Quantize the original model before recfuse.transform (quantized "
        "modules are left unfused).")


def _stacked_rows_under(holder: torch.nn.Module):
    """(the transformed model, `holder`'s path in it) for a holder at or above the path of a fused
    module (`_HOLDER_ROOTS`, set by `guard_absorbed`), else None."""
    for mod in holder.modules():
        ref = _HOLDER_ROOTS.get(mod)
        gm = ref() if ref is not None else None
        if gm is not None:
            for path, m in gm.named_modules(remove_duplicate=False):
                if m is holder:
                    return gm, path
    return None


# holder at the path of a module whose calls fusion replaced -> a weak reference to the transformed
# model that holds it (set by `guard_absorbed`; not an attribute, which pickling would have to carry)
_HOLDER_ROOTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fused_reset(holder: torch.nn.Module):
    """``holder.reset_parameters`` for a holder at the path of a fused module whose original class
    has one: the original class's reset_parameters run on a stand-in holding the result's tensors,
    stacked rows written back (`apply_to_fused`). A walk ``for m in model.modules(): if hasattr(m,
    "reset_parameters"): m.reset_parameters()`` otherwise found no such method on recfuse's holders
    and left every fused LayerNorm and Linear as it was, silently (red-team round 19). None where
    there is none to stand in for."""
    path = holder.__dict__.get("_recfuse_path")
    ref = _HOLDER_ROOTS.get(holder)
    gm = ref() if ref is not None else None
    signature = (getattr(gm, "_recfuse_absorbed", None) or {}).get(path) if gm is not None else None
    cls = _module_class(signature[0]) if signature else None
    if cls is None or not callable(getattr(cls, "reset_parameters", None)):
        return None

    def reset_parameters():
        apply_to_fused(gm, lambda m: m.reset_parameters(), only=path)

    return reset_parameters


def _refuse_stacked_away_replacement(children: dict, name, value) -> None:
    """Refuse putting `value` where `children` (a `_FusedAway`'s modules) holds the `_FusedAway`
    of a module whose tensors fusion stacked: the fused graph would never call it."""
    if (isinstance(value, torch.nn.Module) and not isinstance(value, _FusedAway)
            and isinstance(dict.get(children, name), _FusedAway)):
        from ..errors import RecfuseError

        raise RecfuseError(
            f"cannot replace `{name}`: recfuse.transform stacked the tensors of the module that stood "
            "here into parameters of the transformed model (see its stacked_parameters()), so a "
            "module put here would never be called. Replace it in the original model before "
            "recfuse.transform, or load its state_dict into the transformed model.")


class _StackedAwayChildren(dict):
    """The ``_modules`` of a `_FusedAway`: writing another module over a stacked-away child
    straight into the dict (``model.lns._modules["1"] = nn.LayerNorm(D)``) is refused as
    ``model.lns[1] = ...`` is; before, the module was silently never called (0.33 off the original
    edited alike; red-team round 24). Copies and loads put `_FusedAway` children back: allowed."""

    def __setitem__(self, name, value):
        _refuse_stacked_away_replacement(self, name, value)
        super().__setitem__(name, value)


class _FusedAway(_FusedHolder):
    """Stands at the path of a module whose tensors fusion stacked (and which it pruned), so that a
    lookup of an original name reaches `_StackedAwayNames` and its error."""

    def __init__(self):
        super().__init__()
        self.__dict__["_modules"] = _StackedAwayChildren(self._modules)

    def __setattr__(self, name, value):
        _refuse_stacked_away_replacement(self._modules, name, value)
        super().__setattr__(name, value)

    def add_module(self, name, module):
        # ``register_module`` / ``add_module`` wrote past `__setattr__`: the module was silently
        # never called (0.26 off the original edited alike)
        _refuse_stacked_away_replacement(self._modules, name, module)
        super().add_module(name, module)

    def __getitem__(self, idx):
        # `model.lns[1]` of a fused ModuleList / Sequential reaches the holder at that path
        key = str(idx if idx >= 0 else idx + len(self._modules)) if isinstance(idx, int) else idx
        if key not in self._modules:
            raise IndexError(f"index {idx} is out of range") if isinstance(idx, int) else KeyError(idx)
        return self._modules[key]

    def __setitem__(self, idx, module):
        self.__setattr__(str(idx if not isinstance(idx, int) or idx >= 0 else idx + len(self._modules)), module)

    def __delitem__(self, idx):
        from ..errors import RecfuseError

        raise RecfuseError(
            f"cannot delete `{idx}`: recfuse.transform stacked the tensors of the modules that stood here into "
            "parameters of the transformed model, whose graph computes every feature; edit the original model "
            "and transform it again.")

    def extra_repr(self) -> str:
        return "fused by recfuse.transform"


class _RefusedHooks(collections.OrderedDict):
    """The (empty) hook dicts of a module whose calls fusion replaced: registering a hook on it
    raises `message`, since the fused graph never calls the module and the hook would silently
    never run (forward hooks, pre-hooks, backward hooks; spectral_norm, weight_norm and
    torch.nn.utils.prune register pre-hooks too)."""

    def __init__(self, message: str = ""):
        super().__init__()
        self.message = message

    def __setitem__(self, k, v):
        from ..errors import RecfuseError

        raise RecfuseError(self.message)

    def __reduce__(self):
        return (_RefusedHooks, (self.message,))


_GUARDED_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def guard_absorbed(gm: torch.nn.Module) -> None:
    """Make each module whose calls fusion replaced (`gm._recfuse_absorbed`: path -> its
    `module_signature`) refuse what the fused graph would silently ignore: hooks registered on it,
    plain attributes set on it (on the holders torch.fx leaves in its place) and a replacement by a
    module of another class or settings (`check_replacement`)."""
    for path, signature in getattr(gm, "_recfuse_absorbed", {}).items():
        owner, mod = None, gm
        *parents, leaf = path.split(".")
        for part in parents:
            owner = mod
            mod = mod._modules.get(part)
            if mod is None:
                break
            if type(mod) is torch.nn.Module:
                mod.__class__ = _FusedHolder
        if mod is None:
            continue
        mod.__dict__.setdefault("_recfuse_children", {})[leaf] = (path, signature)
        mod = mod._modules.get(leaf)
        if mod is None:
            continue
        if type(mod) is torch.nn.Module:
            mod.__class__ = _FusedHolder
        if isinstance(mod, _FusedHolder):
            mod.__dict__["_recfuse_path"] = path
            _HOLDER_ROOTS[mod] = weakref.ref(gm)
        _refuse_hooks(mod, path)


def _refuse_hooks(mod: torch.nn.Module, path: str, message: Optional[str] = None) -> None:
    message = message or (f"cannot register a hook on `{path}`: recfuse.transform fused its calls into the "
               "transformed model's graph, which no longer calls this module, so the hook would never "
               "run. Register it on the original model before recfuse.transform (a module with hooks "
               "is left unfused), or on the transformed model itself.")
    for k in _GUARDED_HOOK_DICTS:
        d = mod.__dict__.get(k)
        if isinstance(d, dict) and not d and not isinstance(d, _RefusedHooks):
            mod.__dict__[k] = _RefusedHooks(message)


def mark_stacked_away(gm: torch.nn.Module) -> None:
    """Make every original name of a tensor that fusion stacked (``lns.0.weight``) resolve on `gm`
    to a None that refuses to be set, naming the stacked parameter and row that hold it now; and
    let optimizers over the stacked parameters know which rows they hold (`optim_state`)."""
    from . import optim_state

    if getattr(gm, "_recfuse_stacked", None):
        optim_state.register(gm)
    for new, olds in getattr(gm, "_recfuse_stacked", {}).items():
        for row, old in enumerate(olds):
            owner_path, _, leaf = old.rpartition(".")
            owner = gm
            for part in owner_path.split(".") if owner_path else ():
                sub = owner._modules.get(part)
                if sub is None:
                    if part in owner.__dict__ or part in owner._parameters or part in owner._buffers:
                        break
                    sub = _FusedAway()
                    owner.add_module(part, sub)
                owner = sub
            else:
                if leaf in owner._parameters or dict.__contains__(owner._buffers, leaf) or leaf in owner._modules:
                    continue
                if not isinstance(owner._buffers, _StackedAwayNames):
                    owner._buffers = _StackedAwayNames(owner._buffers)
                    owner._buffers.away = {}
                owner._buffers.away[leaf] = (
                    f"`{old}` of the original model is row {row} of the parameter `{new}` of the model "
                    "recfuse.transform returned (fusion stacked it); it cannot be replaced under its "
                    "original name (torch.func.functional_call, setattr). Pass the transformed model's "
                    "names: `transformed.transformed_parameters(params)` maps a dict keyed by the original "
                    "names onto them (rows stacked with torch.stack, so gradients reach your tensors).")
    guard_absorbed(gm)
    guard_settings(gm)


def transformed_parameters(module: torch.nn.Module, params: dict) -> dict:
    """`params` keyed by the original model's names -> keyed by `module`'s (see
    `TransformedGraphModule.transformed_parameters`)."""
    stacked = getattr(module, "_recfuse_stacked", {})
    taken = {o for olds in stacked.values() for o in olds}
    out = {k: v for k, v in params.items() if k not in taken}
    for new, olds in stacked.items():
        if any(o in params for o in olds):
            cur = getattr(module, new)
            out[new] = torch.stack([params[o] if o in params else cur[i] for i, o in enumerate(olds)])
    return out


class _StandInTensors(dict):
    """The `_parameters` / `_buffers` of a stand-in (`apply_to_fused`) once `apply` has returned:
    reading them raises, so that a module kept from the walk (to build an optimizer group or
    register hooks later) cannot hand out copies that the fused graph never reads."""

    message = ""

    def _expired(self, *args, **kwargs):
        from ..errors import RecfuseError

        raise RecfuseError(self.message)

    __getitem__ = get = items = values = keys = __iter__ = __contains__ = __len__ = _expired


def _module_class(qualname: str):
    """The class a `module_signature` names, or None where it cannot be imported (a local class)."""
    if "<locals>" in qualname:
        return None
    parts = qualname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = sys.modules.get(".".join(parts[:i]))
        if mod is None:
            continue
        obj = mod
        try:
            for a in parts[i:]:
                obj = getattr(obj, a)
        except AttributeError:
            return None
        return obj if isinstance(obj, type) and issubclass(obj, torch.nn.Module) else None
    return None


def _stand_in(gm: torch.nn.Module, path: str, signature: tuple, holder: torch.nn.Module):
    """A module of the original class and settings at `path` whose tensors are those the result
    holds for it: the holder's own (the very objects) and clones of the stacked rows (written back
    by `apply_to_fused`). None where the class cannot be imported."""
    cls = _module_class(signature[0])
    if cls is None:
        return None, {}
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    m.__dict__.update(dict(signature[1]))
    rows = {}
    for new, olds in getattr(gm, "_recfuse_stacked", {}).items():
        for row, old in enumerate(olds):
            owner, _, leaf = old.rpartition(".")
            if owner == path:
                stacked = getattr(gm, new)
                value = stacked[row].detach().clone()
                if isinstance(stacked, torch.nn.Parameter):
                    m._parameters[leaf] = torch.nn.Parameter(value, requires_grad=stacked.requires_grad)
                else:
                    m._buffers[leaf] = value
                rows[leaf] = (new, row, m._parameters.get(leaf, m._buffers.get(leaf)))
    for k, t in holder._parameters.items():
        m._parameters.setdefault(k, t)
    for k, t in dict.items(holder._buffers):
        m._buffers.setdefault(k, t)
    weight = m._parameters.get("weight")
    if issubclass(cls, torch.nn.Linear) and weight is not None and weight.dim() == 2:
        # module_signature leaves out the shape settings; init functions read them (fan in / out)
        m.__dict__.setdefault("in_features", weight.shape[1])
        m.__dict__.setdefault("out_features", weight.shape[0])
    _refuse_hooks(m, path, (
        f"cannot register a hook on `{path}` (met in `apply`): recfuse.transform fused its calls into the "
        "transformed model's graph, which no longer calls this module, so the hook would never run. "
        "Register it on the original model before recfuse.transform."))
    return m, rows


def _without_inplace(signature: tuple) -> tuple:
    return (signature[0], tuple(kv for kv in signature[1] if kv[0] != "inplace"))


def apply_to_fused(gm: torch.nn.Module, fn, only: Optional[str] = None) -> torch.nn.Module:
    """``gm.apply(fn)`` where `fn` meets, at the path of each module whose calls fusion replaced,
    a module of the original's class with its current tensors (stacked rows as copies, written
    back when `fn` changed them) instead of recfuse's holder there. Re-initialisation recipes
    (``model.apply(init_fn)`` with ``isinstance(m, nn.LayerNorm)``) otherwise silently skipped
    every fused LayerNorm and Linear (red-team round 18). What the fused graph could not follow
    is refused: new settings, hooks, parameters added or removed, one row of a stacked parameter
    frozen while others train. With `only` (the path of one such module), `fn` is called on that
    module's stand-in alone (`_FusedHolder.reset_parameters`)."""
    from ..errors import RecfuseError

    absorbed = getattr(gm, "_recfuse_absorbed", None) or {}
    stand_ins, missed = {}, []
    if only is not None:
        holder = gm
        for part in only.split("."):
            holder = holder._modules[part]
        m, rows = _stand_in(gm, only, absorbed[only], holder)
        stand_ins[only] = (m, rows, holder, dict(m._parameters), dict(m._buffers))
        fn(m)

    def walk(mod, path):
        for name, child in mod._modules.items():
            if child is None:
                continue
            sub = f"{path}.{name}" if path else name
            if sub in absorbed:
                m, rows = _stand_in(gm, sub, absorbed[sub], child)
                if m is None:
                    missed.append(sub)
                    child.apply(fn)
                    continue
                stand_ins[sub] = (m, rows, child, {k: t for k, t in m._parameters.items()},
                                  {k: t for k, t in m._buffers.items()})
                m.apply(fn)
            elif isinstance(child, TransformedGraphModule) or not any(p.startswith(sub + ".") for p in absorbed):
                child.apply(fn)
            else:
                walk(child, sub)
        fn(mod)

    if only is None:
        walk(gm, "")
    for path in absorbed if only is None else ():
        if path not in stand_ins and path not in missed:
            # a module without tensors (nn.Tanh, nn.LeakyReLU) that torch.fx dropped from the result:
            # fn still meets it, so that a setting it changes is refused rather than ignored
            m, rows = _stand_in(gm, path, absorbed[path], torch.nn.Module())
            if m is not None:
                stand_ins[path] = (m, rows, None, dict(m._parameters), dict(m._buffers))
                m.apply(fn)
    if missed:
        log.warning("recfuse: apply(fn) on the transformed model met recfuse's holders at %s, whose calls "
                    "fusion replaced (their class could not be imported to stand in for them); fn did not "
                    "see them as the original's modules. Apply fn to the original before recfuse.transform.",
                    ", ".join(f"`{p}`" for p in missed))
    grads = {}
    with torch.no_grad():
        for path, (m, rows, holder, params, buffers) in stand_ins.items():
            # `inplace` changes no value: the fused graph computes activations out of place anyway
            if _without_inplace(module_signature(m)) != _without_inplace(absorbed[path]):
                raise RecfuseError(
                    f"`apply(fn)` changed the settings of `{path}` ({dict(absorbed[path][1])} -> "
                    f"{dict(module_signature(m)[1])}): recfuse.transform fused its calls into the graph, which keeps "
                    "the original settings. Change them on the original model before recfuse.transform.")
            if set(m._parameters) != set(params) or set(m._buffers) != set(buffers):
                raise RecfuseError(
                    f"`apply(fn)` added or removed tensors of `{path}` ({sorted(params) + sorted(buffers)} -> "
                    f"{sorted(m._parameters) + sorted(m._buffers)}), which recfuse.transform fused into its graph. "
                    "Do it on the original model before recfuse.transform.")
            for k in list(params) + list(buffers):
                t = m._parameters[k] if k in params else m._buffers[k]
                before = params.get(k, buffers.get(k))
                if k in rows:
                    new, row, _ = rows[k]
                    stacked = getattr(gm, new)
                    if t is None or t.shape != stacked[row].shape:
                        raise RecfuseError(
                            f"`apply(fn)` set `{path}.{k}` to a tensor of shape {None if t is None else tuple(t.shape)}; it "
                            f"is row {row} of `{new}` {tuple(stacked.shape)} of the transformed model.")
                    stacked[row].copy_(t)
                    if isinstance(stacked, torch.nn.Parameter):
                        grads.setdefault(new, {})[row] = (f"{path}.{k}", t.requires_grad)
                elif t is not before:
                    setattr(holder, k, t)
            for d in ("_parameters", "_buffers"):
                expired = _StandInTensors()
                expired.message = (
                    f"this {type(m).__name__} stood in for `{path}` of the transformed model while `apply(fn)` ran; "
                    "recfuse.transform fused that module into its graph and keeps its tensors elsewhere "
                    f"(stacked_parameters(): {sorted({v[0] for v in rows.values()})}). Use the transformed "
                    "model's own parameters (named_parameters()).")
                m.__dict__[d] = expired
        for new, flags in grads.items():
            stacked = getattr(gm, new)
            wanted = {f for _, f in flags.values()}
            if len(flags) == stacked.shape[0] and len(wanted) == 1:
                stacked.requires_grad_(wanted.pop())
            elif wanted != {stacked.requires_grad}:
                changed = [n for n, f in flags.values() if f != stacked.requires_grad]
                raise RecfuseError(
                    f"`apply(fn)` set requires_grad of {', '.join(f'`{n}`' for n in changed)} but not of the other rows of "
                    f"`{new}` (recfuse.transform stacked them into one parameter, whose rows cannot be frozen one by one). "
                    "Freeze them in the original model and transform it (a frozen feature stays frozen), or transform "
                    "with stack_parameters=False.")
    return gm


def _restoring_grad_mode(forward):
    """`forward` that gives the caller back its grad mode when the model's code raised inside a
    ``torch.no_grad()`` region: generated graph code has no ``finally`` for the region's exit."""

    def wrapped(self, *args, **kwargs):
        mode = torch.is_grad_enabled()
        try:
            return forward(self, *args, **kwargs)
        finally:
            torch._C._set_grad_enabled(mode)

    wrapped.__wrapped__ = forward
    return wrapped


# nn.Module.__call__ as torch defines it: fx's tracers patch it while they trace (to record module
# calls), and a call made then must go through the patched one.
_MODULE_CALL = torch.nn.Module.__call__
_is_compiling = torch.compiler.is_compiling
_FX_TRACE_FLAG_KNOWN = isinstance(getattr(_fx_symbolic_trace, "_is_fx_tracing_flag", None), bool)
_tracing_state = torch._C._get_tracing_state


def _plain_call(module: torch.nn.Module) -> bool:
    """Whether ``module(...)`` is just ``module.forward(...)`` now: no hooks of the module or global
    ones, no ``module.compile()``, no TorchScript trace, no fx tracer patching nn.Module.__call__,
    no Dynamo trace (which reads the hooks itself). nn.Module._call_impl's own fast-path test."""
    d = module.__dict__
    return not (d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"]
                or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks or _nn_module._global_backward_pre_hooks
                or d.get("_compiled_call_impl") is not None or torch.nn.Module.__call__ is not _MODULE_CALL
                or _tracing_state() or _is_compiling())


def _lean_call(self, *args, **kwargs):
    """``__call__`` of a transformed module: ``forward`` directly when calling it is all that
    nn.Module.__call__ would do (`_plain_call`), else GraphModule's call. Skipping GraphModule's
    `_WrappedCall` and nn.Module's `_wrapped_call_impl` / `_call_impl` layers saves ~5 us a call
    (benchmarks/NOTES.md, "CPU host path"); an error of the generated code is reported as
    `_WrappedCall` reports it."""
    if not _plain_call(self):
        if _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks:
            _note_global_hooks(self)
        if _is_compiling():
            # torch.compile traces the call: Dynamo refuses to trace GraphModule's `_WrappedCall`
            # (a skipped function: fullgraph=True raised, otherwise a graph break), and
            # nn.Module.__call__ (hooks included) it traces.
            return _MODULE_CALL(self, *args, **kwargs)
        return self._wrapped_call(self, *args, **kwargs)
    try:
        return self.forward(*args, **kwargs)
    except Exception as e:
        _report_generated_code_error(e)
        raise


_GLOBAL_HOOKS_NOTED: set = set()


def _note_global_hooks(gm) -> None:
    """Warn, once per set of global forward hooks and model, that the hooks do not see the
    modules whose calls fusion replaced: a hook that changes outputs would be skipped there
    (0.125 off the original with a clamp of every Linear's output; red-team round 17). Not
    refused: PyTorch's observers (FlopCounterMode, CommDebugMode, module_tracker) register global
    hooks that change nothing."""
    absorbed = getattr(gm, "_recfuse_absorbed", None)
    if not absorbed:
        return
    key = (id(gm), tuple(_nn_module._global_forward_hooks), tuple(_nn_module._global_forward_pre_hooks))
    if key in _GLOBAL_HOOKS_NOTED:
        return
    _GLOBAL_HOOKS_NOTED.add(key)
    log.warning("recfuse: global module forward hooks are registered; they run on the transformed model "
                "and the modules its graph still calls, but not on the modules fusion replaced (%s), "
                "whose calls are now one fused op. A hook that changes those modules' outputs is not "
                "applied to them: make the change in the model's code, or run the original model.",
                ", ".join(sorted(absorbed)[:6]) + (", ..." if len(absorbed) > 6 else ""))


def _report_generated_code_error(e: Exception) -> None:
    """What torch.fx's `_WrappedCall` does with an exception of a GraphModule's call: an error raised
    by a line of the generated forward is printed with that line in context, and raised without
    the traceback; any other propagates as it is (the caller re-raises)."""
    if not e.__traceback__:
        raise AssertionError("Exception has no traceback") from e
    topmost = traceback.StackSummary.extract(traceback.walk_tb(e.__traceback__))[-1]
    if "eval_with_key" in topmost.filename:
        print(_WrappedCall._generate_error_message(topmost), file=sys.stderr)
        raise e.with_traceback(None)


_MODULE_GETATTR = torch.nn.Module.__getattr__
_OBJECT_GETATTRIBUTE = object.__getattribute__
# (type, attribute name) -> whether ``obj.name`` for an obj of that type is what nn.Module's
# __getattr__ finds (no class attribute of that name, nn.Module's __getattr__, object's
# __getattribute__). Bounded: past 4096 entries it starts over (transformed modules each have a
# class of their own).
_PLAIN_MODULE_ATTR: dict = {}
_MISSING = object()


def _plain_module_attr(t: type, name: str) -> bool:
    plain = _PLAIN_MODULE_ATTR.get((t, name))
    if plain is None:
        if len(_PLAIN_MODULE_ATTR) >= 4096:
            _PLAIN_MODULE_ATTR.clear()
        plain = _PLAIN_MODULE_ATTR[(t, name)] = (
            getattr(t, "__getattr__", None) is _MODULE_GETATTR
            and getattr(t, "__getattribute__", None) is _OBJECT_GETATTRIBUTE
            and not hasattr(t, name))
    return plain


def read_attr(obj, atoms: tuple):
    """``obj.a.b...`` for ``atoms = ("a", "b", ...)``: what a transformed graph's ``get_attr`` node
    reads (``self.linear.weight``). nn.Module's attribute lookup fails over to its Python
    ``__getattr__`` for every parameter, buffer and submodule (~0.4 us a hop); for a module whose
    lookup that is (`_plain_module_attr`), this reads the same dicts in the same order directly
    (~0.1 us). Anything else, and any read while an fx Tracer or torch.compile traces, is a plain
    getattr.

    Example:
        >>> lin = torch.nn.Linear(2, 1); m = torch.nn.Module(); m.lin = lin
        >>> read_attr(m, ("lin", "weight")) is lin.weight
        True
    """
    if (_FX_TRACE_FLAG_KNOWN and _fx_symbolic_trace._is_fx_tracing_flag) or _is_compiling():
        root = obj
        for name in atoms:
            obj = getattr(obj, name)
        if isinstance(obj, torch.fx.Proxy) and type(obj.tracer).__module__.startswith("torch.ao.quantization"):
            fused = getattr(root, "_recfuse_absorbed", None) or {}
            path = ".".join(atoms[:-1])
            if atoms[0].startswith("recfuse_") or path in fused:
                _refuse_quantization(path or atoms[0])
        return obj
    return _read_module_attr(obj, atoms)


def _read_module_attr(obj, atoms: tuple):
    """`read_attr` outside tracing: nn.Module's lookup order, read from its dicts directly."""
    for name in atoms:
        t = type(obj)
        plain = _PLAIN_MODULE_ATTR.get((t, name))  # `_plain_module_attr`, its cache inlined
        if not (plain or (plain is None and _plain_module_attr(t, name))):
            obj = getattr(obj, name)
            continue
        d = obj.__dict__
        if name in d:  # an instance attribute comes before nn.Module's __getattr__
            obj = d[name]
            continue
        # nn.Module.__getattr__'s order. A parameter (the usual read) is found by the first lookup.
        for table_name in _MODULE_TABLES:
            table = d.get(table_name)
            if table is not None and name in table:
                obj = table[name]
                break
        else:
            obj = getattr(obj, name)  # raises nn.Module's AttributeError
    return obj


_MODULE_TABLES = ("_parameters", "_buffers", "_modules")


_READ_ATTR_NAME = "recfuse_fx_graph_module_read_attr"


def lean_attribute_reads(graph, code):
    """`code` (a graph's `PythonCode`) with each ``get_attr`` line ``x = self.a.b`` reading through
    `read_attr`: ``x = recfuse_fx_graph_module_read_attr(self, ('a', 'b'))``. Lines keep their
    numbers; targets that are not identifiers keep fx's own text. Pickling imports `read_attr` by
    name, as for any function a graph calls; a saved graph is re-traced with getattr (`read_attr`
    under an fx Tracer)."""
    targets = {n.target for n in graph.nodes if n.op == "get_attr" and isinstance(n.target, str)}
    src = code.src
    replaced = False
    for target in targets:
        atoms = target.split(".")
        if not all(a.isidentifier() for a in atoms):
            continue
        pattern = re.compile(r"(?<= = )" + re.escape("self." + target) + r"(?=$|;|\s)", re.MULTILINE)
        src, n = pattern.subn(f"{_READ_ATTR_NAME}(self, {tuple(atoms)!r})", src)
        replaced = replaced or n > 0
    if not replaced:
        return code
    src = _group_reads(src)
    return dataclasses.replace(code, src=src, globals={**code.globals, _READ_ATTR_NAME: read_attr,
                                                       _READ_ATTRS_NAME: read_attrs})


_READ_ATTRS_NAME = "recfuse_fx_graph_module_read_attrs"
_READ_LINE = re.compile(r"^(\s+)(\w+) = " + _READ_ATTR_NAME + r"\(self, (\(.*\))\)$")


def _group_reads(src: str) -> str:
    """Consecutive read lines ``a = read_attr(self, A)`` / ``b = read_attr(self, B)`` as one call
    over the same lines, ``a, b = read_attrs(self, (A,`` / ``    B))``: one frame and one tracing
    check for all of them (the puzzler's graph reads four in a row). Line numbers are kept."""
    lines = src.split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _READ_LINE.match(lines[i])
        run = [m] if m else []
        j = i + 1
        while m and j < len(lines):
            nxt = _READ_LINE.match(lines[j])
            if not nxt or nxt.group(1) != m.group(1):
                break
            run.append(nxt)
            j += 1
        if len(run) < 2:
            out.append(lines[i])
            i += 1
            continue
        indent = run[0].group(1)
        names = ", ".join(r.group(2) for r in run)
        out.append(f"{indent}{names} = {_READ_ATTRS_NAME}(self, ({run[0].group(3)},")
        out.extend(f"{indent}    {r.group(3)}," for r in run[1:-1])
        out.append(f"{indent}    {run[-1].group(3)}))")
        i = j
    return "\n".join(out)


def read_attrs(obj, paths: tuple) -> tuple:
    """``(read_attr(obj, atoms) for atoms in paths)`` as a tuple, with one tracing check for all
    of them: consecutive ``get_attr`` reads of a transformed graph (`_group_reads`).

    Example:
        >>> lin = torch.nn.Linear(2, 1); m = torch.nn.Module(); m.lin = lin
        >>> read_attrs(m, (("lin", "weight"), ("lin", "bias"))) == (lin.weight, lin.bias)
        True
    """
    if (_FX_TRACE_FLAG_KNOWN and _fx_symbolic_trace._is_fx_tracing_flag) or _is_compiling():
        return tuple(read_attr(obj, atoms) for atoms in paths)
    return tuple([_read_module_attr(obj, atoms) for atoms in paths])


def _rebuild(cls: type, body: dict, import_block: str) -> "TransformedGraphModule":
    plain = reduce_graph_module(body, import_block)
    gm = cls(plain, plain.graph, class_name=body.get("_graphmodule_cls_name", "GraphModule"))
    for k, v in body.items():
        if k not in gm.__dict__ and not k.startswith("_graph"):
            gm.__dict__[k] = v
    if all(k in body for k in ("_parameters", "_buffers", "_modules")):
        _restore_dropped(gm, body)
    mark_stacked_away(gm)
    restore_order(gm)
    return gm


_STATE_ATTRS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def _restore_dropped(gm: GraphModule, attrs: dict) -> None:
    """Put back on `gm` what GraphModule's constructor drops from a module's `__dict__` entries
    `attrs`: the state its graph does not read (unused parameters, buffers) and the forward hooks."""
    carry_state(gm, types.SimpleNamespace(**{k: attrs[k] for k in _STATE_ATTRS if k in attrs}))
    for k in HOOK_ATTRS:
        if attrs.get(k):
            getattr(gm, k).update(attrs[k])


class TransformedGraphModule(_ChecksReplacements, GraphModule):
    """A GraphModule produced by `recfuse.transform`.

    Loads a state_dict of the original model (its per-feature keys go to the stacked parameters),
    and keeps that ability and its `recfuse_report` through `copy.deepcopy` and
    `torch.save`/`torch.load` (``weights_only=False``, as for any pickled module).

    Example:
        >>> import copy, io, torch, recfuse
        >>> from recfuse.puzzler import SplitStack
        >>> m = SplitStack(8, 1); x = torch.randn(4 * 3 * 8)
        >>> fused = recfuse.transform(m, (x, 4, 8))
        >>> buf = io.BytesIO(); torch.save(fused, buf); _ = buf.seek(0)
        >>> again = torch.load(buf, weights_only=False)
        >>> torch.allclose(again(x, 4, 8), m(x, 4, 8), atol=1e-6), type(again).__mro__[1].__name__
        (True, 'TransformedGraphModule')
    """

    # The tracer torch.load re-traces the saved code with; capture sets it (it owns the tracers).
    rebuild_tracer = None

    def __init__(self, root, graph, class_name: str = "GraphModule", *, codegen: bool = True):
        # codegen=False: the caller is about to rewrite the graph and recompiles once it is done;
        # generating code for a graph of 30,000 nodes that fusion shrinks to 10 costs seconds.
        self.__dict__["_recfuse_skip_codegen"] = not codegen
        super().__init__(root, graph, class_name)

    def recompile(self):
        if self.__dict__.pop("_recfuse_skip_codegen", False):
            return None
        # The generated code reads parameters and submodules through `read_attr` (see there);
        # GraphModule.recompile gets that code from the graph's python_code, patched for the call.
        graph = self._graph
        graph_python_code = graph.python_code
        graph.__dict__["python_code"] = lambda *a, **k: lean_attribute_reads(graph, graph_python_code(*a, **k))
        try:
            result = super().recompile()
        finally:
            graph.__dict__.pop("python_code", None)
        from .runtime import set_grad_mode

        if any(n.op == "call_function" and n.target is set_grad_mode for n in self.graph.nodes):
            type(self).forward = _restoring_grad_mode(type(self).forward)
        # GraphModule.recompile has just set the class's __call__ (each GraphModule has a class of
        # its own) to its error-reporting wrapper; the lean call keeps that for what it must.
        type(self).__call__ = _lean_call
        return result

    def stacked_parameters(self) -> dict:
        """{stacked parameter name: the original parameters it holds, one row each, in order}.

        Fusion renames the per-feature parameters it stacks (``lns.3.weight`` becomes row 3 of
        ``recfuse_g0_ln_weight``), so optimizer parameter groups chosen by name must be built from
        the result: this says which original names each stacked parameter stands for.

        Example:
            >>> import torch, recfuse
            >>> class PerFeature(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.lns = torch.nn.ModuleList(torch.nn.LayerNorm(8) for _ in range(3))
            ...         self.lin = torch.nn.Linear(8, 2)
            ...     def forward(self, x):
            ...         ts = [torch.tanh(ln(s)) for ln, s in zip(self.lns, x.split(8, 1))]
            ...         return torch.relu(self.lin(torch.stack(ts, 1)))
            >>> fused = recfuse.transform(PerFeature(), (torch.randn(4, 24),))
            >>> fused.stacked_parameters()["recfuse_g0_ln_weight"]
            ['lns.0.weight', 'lns.1.weight', 'lns.2.weight']
        """
        return {k: list(v) for k, v in getattr(self, "_recfuse_stacked", {}).items()}

    def transformed_parameters(self, params: dict) -> dict:
        """A dict of tensors keyed by the *original* model's names (``lns.3.weight``) -> the same
        keyed by this module's names, for ``torch.func.functional_call(transformed, ...)``: the
        rows of each stacked parameter are stacked with torch.stack (rows not in `params` are the
        module's own), so gradients reach the given tensors; other names pass through.

        Example:
            >>> import torch, recfuse
            >>> m = torch.nn.Module(); m.p = torch.nn.Parameter(torch.zeros(2, 3))
            >>> m._recfuse_stacked = {"p": ["a.weight", "b.weight"]}
            >>> TransformedGraphModule.transformed_parameters(m, {"b.weight": torch.ones(3)})["p"].tolist()
            [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
        """
        return transformed_parameters(self, params)

    def apply(self, fn):
        # fn meets the fused modules as the original's classes (see apply_to_fused)
        if not getattr(self, "_recfuse_absorbed", None):
            return super().apply(fn)
        return apply_to_fused(self, fn)

    _STACKED_KEY = "recfuse_stacked"

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", None)
        stacked = getattr(self, "_recfuse_stacked", None)
        if stacked:
            if metadata is not None and prefix[:-1] in metadata:
                metadata[prefix[:-1]][self._STACKED_KEY] = self.stacked_parameters()
            # The same record as a tensor entry: a state_dict that lost its `_metadata` (``dict(sd)``,
            # ``{k: v.clone() ...}``, a safetensors round trip) still says which feature each stacked
            # row is (red-team round 19; before, such a state_dict loaded the rows by position).
            saved = {k: v for k, v in self.stacked_parameters().items() if prefix + k in destination}
            if saved:  # (non-persistent stacked buffers are not saved)
                destination[prefix + EXTRA_STATE_KEY] = encode_stacked(saved)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        saved = (local_metadata or {}).get(self._STACKED_KEY)
        extra = state_dict.get(prefix + EXTRA_STATE_KEY)
        decoded = decode_stacked(extra)
        if decoded is not None:
            del state_dict[prefix + EXTRA_STATE_KEY]  # recfuse's own record, no tensor of the model
            if saved is None:
                saved = decoded
        unstack_saved_rows(self, state_dict, prefix, saved)
        map_original_keys(self, state_dict, prefix, missing_keys, error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def __deepcopy__(self, memo: dict) -> "TransformedGraphModule":
        res = super().__deepcopy__(memo)
        for k in PRESERVED_ATTRS:
            if k in self.__dict__:
                res.__dict__[k] = copy.deepcopy(self.__dict__[k], memo)
        # What the graph does not read (unused parameters, buffers) and the forward hooks, which
        # GraphModule's constructor drops; the dicts were deep-copied already (found in `memo`).
        _restore_dropped(res, {k: copy.deepcopy(self.__dict__[k], memo)
                               for k in _STATE_ATTRS + HOOK_ATTRS if k in self.__dict__})
        mark_stacked_away(res)
        restore_order(res)
        return res

    def __copy__(self) -> "TransformedGraphModule":
        # ``copy.copy``: a shallow copy, as nn.Module's is (its `__dict__` copied, the same
        # parameter, buffer, submodule and hook dicts). GraphModule.__copy__ built a plain
        # GraphModule of the graph instead, whose constructor keeps only what the graph reads:
        # the model's forward hooks were dropped (0.69 off the original's shallow copy with an
        # ``out * 3 + 1`` hook), so were the guards of traced settings (``copy.scale = 2.0``
        # silently ignored: 0.84 off), the unused state and the original's state_dict keys
        # (red-team round 20). The class (a GraphModule's own, holding its forward) is made anew
        # by recompiling the shared graph; the per-process caches are not shared.
        res = type(self).__new__(type(self))
        res.__dict__.update({k: v for k, v in self.__dict__.items() if k not in TRANSIENT_ATTRS})
        res.recompile()
        return res

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every module it compiles (a parent's submodules too); it
        # failed inside recfuse's holders with "function definitions aren't supported" or "Can't
        # redefine method: __reset_parameters_getter" (red-team round 24)
        from ..errors import RecfuseError

        raise RecfuseError(
            "torch.jit.script cannot compile a model that recfuse.transform returned: its graph calls recfuse's "
            "Python helpers and custom op. Use torch.jit.trace, torch.compile or torch.export on it, or script "
            "the original model.")

    def __reduce__(self) -> tuple[Any, ...]:
        _, (body, import_block) = super().__reduce__()
        for k in TRANSIENT_ATTRS:
            body.pop(k, None)
        # Loading re-traces the saved code; this tracer keeps `self.training` reads as reads.
        body["_tracer_cls"] = self.rebuild_tracer
        cls = next(c for c in type(self).__mro__ if "<locals>" not in c.__qualname__)
        return (_rebuild, (cls, body, import_block))
