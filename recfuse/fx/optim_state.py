"""Optimizer state of the parameters `recfuse.transform` stacked, across transforms that stack the
rows in another order.

Two transforms of one model may stack its per-feature parameters in other orders (a dict input
whose keys came in another order, groups numbered otherwise). A model checkpoint maps its rows by
name (`graph_module.unstack_saved_rows`), but an optimizer state_dict has no names and loads by
position: Adam's moments (SGD's momentum) of row i went to whatever feature is row i in the
loader, so the resumed training drifted from the original's, silently (0.21-1.45 off after three
steps, red-team round 19).

So every optimizer step over a stacked parameter (a global step pre-hook, installed with the
first stacked parameter) records, in the parameter's group, the original names its rows stand for
(``group["recfuse_stacked_rows"] = {position in the group: [names]}``); the group travels in the
optimizer's state_dict and comes back with ``load_state_dict``. At the first step after the
optimizer's state or groups changed, the state of each stacked parameter is checked against that
record: rows in another order are put where this parameter holds them (by name), rows of other
features are refused. State without a record (saved before this), loaded into a parameter whose
model checkpoint came in another row order, is refused too: it would load by position.
"""
from __future__ import annotations

import weakref

import torch
import torch.optim.optimizer as _torch_optimizer

__all__ = ["GROUP_KEY", "register", "note_loaded_rows", "check_optimizer"]

GROUP_KEY = "recfuse_stacked_rows"

# Transformed models that stacked parameters. Which rows a stacked parameter holds is read from
# them (`_stacked_rows`) when an optimizer is checked, by name: keyed by the parameter objects
# (a weak dictionary, before red-team round 23), a parameter replaced by ``load_state_dict(...,
# assign=True)`` or ``setattr`` had no record, so its optimizer state loaded by position silently,
# and the weak references made ``torch.utils.swap_tensors`` refuse every stacked parameter
# (``torch.__future__.set_swap_module_params_on_conversion(True)`` then ``.to()`` / ``.half()`` /
# ``load_state_dict``).
_MODULES: "weakref.WeakSet" = weakref.WeakSet()
# transformed model -> {stacked name: the rows, in the saver's order, of the last model checkpoint
# loaded into it in another order than its own}
_LOADED_REORDERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# optimizer -> ids of the state and groups it was last checked with
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_HANDLE = None


def register(module: torch.nn.Module) -> None:
    """`module` (a transformed model) holds stacked parameters (its ``_recfuse_stacked``)."""
    global _HANDLE
    _MODULES.add(module)
    if _HANDLE is None:
        _HANDLE = _torch_optimizer.register_optimizer_step_pre_hook(check_optimizer)


def note_loaded_rows(module: torch.nn.Module, name: str, saved_rows, reordered: bool) -> None:
    """A model checkpoint whose `saved_rows` were stacked in another order (`reordered`) than
    `module`'s stacked parameter `name`, or in the same, was loaded into it."""
    loaded = _LOADED_REORDERED.setdefault(module, {})
    if reordered:
        loaded[name] = tuple(saved_rows)
    else:
        loaded.pop(name, None)


def _stacked_rows() -> dict:
    """id(parameter) -> (its rows, the rows of a checkpoint loaded into it in another order or None)
    for every stacked parameter registered now in a live transformed model."""
    out = {}
    for module in list(_MODULES):
        loaded = _LOADED_REORDERED.get(module, {})
        for name, rows in getattr(module, "_recfuse_stacked", {}).items():
            p = module._parameters.get(name)
            if isinstance(p, torch.Tensor):
                out[id(p)] = (tuple(rows), loaded.get(name))
    return out


def _per_row(value, param: torch.Tensor) -> bool:
    """Whether an optimizer state entry holds one slice per row of `param` (exp_avg, momentum,
    Adafactor's row and column variances of a per-feature weight), not a scalar (step)."""
    return (isinstance(value, torch.Tensor) and value.dim() == param.dim() and value.dim() >= 1
            and value.shape[0] == param.shape[0]
            and all(s in (1, p) for s, p in zip(value.shape[1:], param.shape[1:])))


def check_optimizer(opt, args=None, kwargs=None):
    """The global optimizer step pre-hook (see the module's docstring)."""
    if torch.compiler.is_compiling():
        return None
    if not _MODULES:
        return None
    groups = opt.param_groups
    key = (id(opt.state), tuple(map(id, groups)))
    if _CHECKED.get(opt) == key:
        return None
    _check(opt, groups)
    _CHECKED[opt] = key
    return None


def _check(opt, groups) -> None:
    from ..errors import RecfuseError

    mine = []  # (group, {position: (param, its rows)})
    saved_rows = {}  # original name -> (state of the parameter that held it when saved, its row there)
    moved = []  # (param, its rows, the rows its loaded state was saved for)
    stacked = _stacked_rows()
    for group in groups:
        here = {}
        saved = group.get(GROUP_KEY)
        saved = saved if isinstance(saved, dict) else {}
        for pos, p in enumerate(group.get("params", ())):
            state = opt.state.get(p)
            there = saved.get(pos, saved.get(str(pos))) if state else None
            if there is not None:
                there = list(there)
                for i, name in enumerate(there):
                    saved_rows[name] = (state, i)
            rows, loaded = stacked.get(id(p), (None, None))
            if rows is None:
                continue
            rows = list(rows)
            here[pos] = (p, rows)
            if not state:
                continue  # nothing loaded: the state this optimizer builds is in p's own order
            if there is None:
                if loaded is not None and list(loaded) != rows:
                    raise RecfuseError(
                        f"{type(opt).__name__}: the state of a parameter that recfuse.transform stacked (rows "
                        f"{_names(rows)}) has no record of the features its rows stand for (an optimizer "
                        "state_dict saved without recfuse's `recfuse_stacked_rows` in its param_groups), and the "
                        f"model checkpoint loaded into this parameter stacked them in another order "
                        f"({_names(loaded)}): loaded by position, each feature's state would be another's. Resume "
                        "this optimizer into a transform whose stacked_parameters() equals the saver's, or start "
                        "it afresh.")
            elif there != rows:
                moved.append((p, rows, there))
        mine.append((group, here))
    # Rows in another order, or held by another stacked parameter of the saver (its groups numbered
    # otherwise): each row's state is taken, by name, from wherever the saver kept it.
    new_states = []
    for p, rows, there in moved:
        state = opt.state[p]
        missing = [r for r in rows if r not in saved_rows]
        if missing:
            raise RecfuseError(
                f"{type(opt).__name__}: the loaded state of a parameter that recfuse.transform stacked was saved "
                f"for the rows {_names(there)}; this parameter holds {_names(rows)}, and the state of "
                f"{_names(missing)} is nowhere in the loaded optimizer state: its rows would train other features. "
                "Load it into a transform of the same model (same features).")
        new = {}
        for k, v in state.items():
            if not _per_row(v, p):
                continue
            parts = []
            for r in rows:
                src, i = saved_rows[r]
                w = src.get(k)
                if not isinstance(w, torch.Tensor) or w.dim() != v.dim() or w.shape[1:] != v.shape[1:]:
                    raise RecfuseError(
                        f"{type(opt).__name__}: the loaded state `{k}` of row `{r}` does not match the stacked "
                        f"parameter that holds it now ({tuple(v.shape)}); load it into a transform of the same model.")
                parts.append(w[i])
            new[k] = torch.stack(parts)
        new_states.append((state, new))
    with torch.no_grad():
        for state, new in new_states:
            for k, v in new.items():
                state[k].copy_(v)
    for group, here in mine:
        if here:
            group[GROUP_KEY] = {pos: rows for pos, (_, rows) in here.items()}
        elif GROUP_KEY in group:
            del group[GROUP_KEY]


def _names(rows) -> str:
    rows = list(rows)
    return "[" + ", ".join(rows[:4]) + (", ..." if len(rows) > 4 else "") + "]"
