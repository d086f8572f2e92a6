"""The optimizer step in pieces: a foreach or fused group larger than a piece steps as several
groups, joined again after the step."""

from __future__ import annotations

import torch

from . import _C

_MISSING = object()


def _same(a, b) -> bool:
    """Equal values of an optimizer's group entry (tensors element for element)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001: values that cannot be compared are not the same
        return False


def _multi_tensor(group) -> bool:
    if group.get("fused") or group.get("foreach"):
        return True
    # foreach=None: torch picks foreach where every tensor is on a GPU.
    return group.get("foreach", False) is None and group.get("fused") is None and any(
        p.is_cuda for p in group["params"])


def _step_bytes(p: torch.Tensor) -> int:
    return 4 * p.numel() * p.element_size()  # the parameter, its gradient and (Adam) two moments


def _chunks(params: list, limit: int) -> list:
    chunks, size = [[]], 0
    for p in params:
        if chunks[-1] and size + _step_bytes(p) > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += _step_bytes(p)
    return chunks


def _join_groups(opt, checked: bool) -> None:
    """Puts back the groups Session._split_groups split. checked (the step returned): what the
    optimizer wrote into a group must be the same in each of its pieces (a step counter is); a
    value that differs depends on which parameters a piece held, so stepping in pieces changed
    the arithmetic: refused, not hidden."""
    saved = getattr(opt, "_tidal_split", None)
    if saved is None:
        return
    groups, whole, pieces = saved
    opt._tidal_split = None
    opt.param_groups[:] = groups
    for g, params in whole:
        g["params"] = params
    if not checked:
        return
    for g, piece in pieces:
        for key, value in piece.items():
            if key != "params" and not _same(g.get(key, _MISSING), value):
                raise _C.Error(
                    f"optimizer {type(opt).__name__} wrote param_groups[...][{key!r}] "
                    "differently for parts of one group: tidal steps a foreach/fused group in "
                    "parts that fit the budget, and this optimizer keeps state in its group that "
                    "depends on all of its parameters. Give it foreach=False (and fused=False), "
                    "or a budget that holds the group whole")
