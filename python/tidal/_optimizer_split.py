"""The optimizer step in pieces: a foreach or fused group larger than a piece steps as several
groups, joined again after the step (a plan-mode Session's hooks on the optimizer)."""

from __future__ import annotations

from typing import Callable

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


def multi_tensor(group) -> bool:
    if group.get("fused") or group.get("foreach"):
        return True
    # foreach=None: torch picks foreach where every tensor is on a GPU.
    return group.get("foreach", False) is None and group.get("fused") is None and any(
        p.is_cuda for p in group["params"])


def step_bytes(p: torch.Tensor) -> int:
    return 4 * p.numel() * p.element_size()  # the parameter, its gradient and (Adam) two moments


def _chunks(params: list, limit: int) -> list:
    chunks, size = [[]], 0
    for p in params:
        if chunks[-1] and size + step_bytes(p) > limit:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += step_bytes(p)
    return chunks


def join_groups(opt, checked: bool) -> None:
    """Puts back the groups OptimizerSplit.split split. checked (the step returned): what the
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


class OptimizerSplit:
    """A foreach or fused optimizer step is one op over every parameter of a group, with its
    gradient and state: no plan can bring less than all of them in at once. For the step, a
    group larger than a piece (an eighth of the budget) steps in pieces: the user's group itself
    holds the first piece's parameters, and copies of it (the same hyperparameters; the state is
    kept by parameter) the others. The same elementwise arithmetic, bit for bit. After the step
    join_groups gives the group all its parameters again, and what the optimizer wrote into it
    (a step counter) is the first piece's, checked against the others'."""

    def __init__(self, byte_budget: int) -> None:
        self._byte_budget = byte_budget  # the session's budget when given in bytes, else 0
        self._piece_bytes: int | None = None

    def piece_bytes(self, opt, measured_budget: Callable[[], int]) -> int:
        """Fixed at the first step, so that every step (profiled or executed) has the same
        pieces, and so the same ops (a piece size changed after the first plan would make a new
        step shape, planned from what the old one measured): an eighth of a budget known then
        (in bytes, or already measured: measured_budget(), 0 when not), else an eighth of the
        split groups' state, at most 64 MiB."""
        if self._piece_bytes is None:
            budget = measured_budget()
            if not budget and not self._byte_budget:
                state = sum(step_bytes(p) for g in opt.param_groups if multi_tensor(g)
                            for p in g["params"])
                budget = min(state, 512 << 20)
            budget = budget or self._byte_budget
            self._piece_bytes = max(1 << 20, budget // 8)
        return self._piece_bytes

    def split(self, opt, measured_budget: Callable[[], int]) -> None:
        """Before the step: the multi-tensor groups of `opt` larger than a piece become pieces
        (kept in opt._tidal_split for join_groups). Does nothing while they are split."""
        if getattr(opt, "_tidal_split", None) is not None:
            return
        if not any(multi_tensor(g) for g in opt.param_groups):
            return
        limit = self.piece_bytes(opt, measured_budget)
        groups, pieces, whole = [], [], []
        for g in opt.param_groups:
            chunks = _chunks(g["params"], limit) if multi_tensor(g) else [g["params"]]
            groups.append(g)
            if len(chunks) == 1:
                continue
            whole.append((g, g["params"]))
            g["params"] = chunks[0]
            for chunk in chunks[1:]:
                piece = {**g, "params": chunk}
                groups.append(piece)
                pieces.append((g, piece))
        if pieces:
            opt._tidal_split = (list(opt.param_groups), whole, pieces)
            opt.param_groups[:] = groups
