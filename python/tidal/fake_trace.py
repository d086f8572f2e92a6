"""Traces of a training step at full size, with no memory and no compute: the user's step run on
fake copies of the model and optimizer under PyTorch's FakeTensorMode, recorded by the same
tracer that profiles real steps (`Session(plan_ahead=step)` plans from them before step 0).

A fake tensor has a shape, a dtype, a device and storage bytes, but no data: every op runs its
meta kernel, so a step of a model larger than the machine traces in about the time its Python
takes. The op sequence is the real step's, op for op, once three things autograd and
FakeTensorMode do differently for a tensor subclass are undone (normalize):
- autograd accumulates a gradient used twice out of place (`aten::add`) where a plain tensor
  that only the buffer holds is accumulated in place (`aten::add_`), and IndexBackward fills its
  zeros with `index_put` instead of `_index_put_impl_`;
- FakeTensorMode records its own steps (`PythonDispatchMode`; `empty_strided`, `set_` and
  `detach` with no tensors where autograd takes a gradient), lifts constants into new fake
  tensors (`lift_fresh`), and keeps a scalar alive after an in-place op on a 0-d tensor;
- op times are fake: they come from a cost model instead (model_op_times), and executed steps
  replace them (the session's retiming).

What fake tensors cannot run (data-dependent shapes: `nonzero`, a mixture-of-experts layer that
loops over the experts its tokens chose; kernels without a meta implementation) raises
FakeTraceError, naming the op: the session then profiles its first steps as without
plan_ahead.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any, Callable, Optional

import torch

from . import _C

StepFn = Callable[[torch.nn.Module, Optional[torch.optim.Optimizer]], Any]


class FakeTraceError(_C.InvalidArgument):
    """The step could not be traced on fake tensors (the reason names the op or the cause)."""


# -- normalisation ---------------------------------------------------------------------------


# Ops whose result may share its input's storage.
_VIEWS = frozenset("aten::" + n for n in (
    "view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "narrow", "squeeze",
    "unsqueeze", "expand", "transpose", "t", "permute", "unflatten", "flatten", "alias",
    "detach", "view_as", "split", "chunk", "unbind", "diagonal", "contiguous", "to",
    "type_as", "expand_as", "reshape_as", "movedim", "split_with_sizes"))


def _alias(tensors: list, alias: dict, out: int, into: int) -> None:
    """Tensor `out` is tensor `into` (an in-place op's result): `into` lives as long as both."""
    alias[out] = into
    a, o = tensors[into], tensors[out]
    if a["freed_after"] >= 0 and (o["freed_after"] < 0 or o["freed_after"] > a["freed_after"]):
        a["freed_after"] = o["freed_after"]


def _fake_only_ops(ops: list) -> set:
    """FakeTensorMode's own records: ops with no tensors of the step that it runs for itself
    (PythonDispatchMode; empty_strided, set_ and detach where autograd takes a gradient)."""
    own = ("PythonDispatchMode", "aten::empty_strided", "aten::set_", "aten::detach")
    return {i for i, o in enumerate(ops)
            if o["name"] in own and not o["inputs"] and not o["outputs"]}


def _accumulates_in_place(ops: list, tensors: list, i: int, first_back: int,
                          last_back: int) -> bool:
    """Op i is autograd's out-of-place accumulation of a gradient into its buffer (between the
    backward pass's first and last op, outside a node) that a plain tensor would do in place:
    the buffer held a fresh tensor (not a view of one: the last op that read it before made
    nothing, a view, and then the real engine too adds out of place)."""
    o = ops[i]
    if not (first_back < i < last_back and o["name"] == "aten::add"
            and o["phase"] != "backward" and len(o["inputs"]) == 2 and len(o["outputs"]) == 1):
        return False
    a, out = tensors[o["inputs"][0]], tensors[o["outputs"][0]]
    if a["persistent"] or a["producer"] < 0 or a["bytes"] != out["bytes"]:
        return False
    readers = [v for v in ops[a["producer"] + 1:i] if a["id"] in v["inputs"]]
    return not readers or bool(readers[-1]["outputs"])


def _undo_out_of_place(ops: list, tensors: list) -> dict:
    """Rewrites the ops that a tensor subclass runs out of place into the real path's in-place
    ones; returns the tensors that became others (id -> id, -1: gone)."""
    back = [i for i, o in enumerate(ops) if o["phase"] == "backward"]
    first_back, last_back = (back[0], back[-1]) if back else (0, -1)
    alias: dict = {}

    def resolve(x: int) -> int:
        while x in alias:
            x = alias[x]
        return x

    for i, o in enumerate(ops):
        o["inputs"] = [resolve(x) for x in o["inputs"]]
        o["outputs"] = [resolve(x) for x in o["outputs"]]
        if o["name"] in _VIEWS:
            # A view of a real tensor (the batch the step closes over) is a view of its fake
            # copy's storage under FakeTensorMode: the real step makes no storage there.
            real = [x for x in o["inputs"] if tensors[x]["producer"] < 0
                    and tensors[x]["name"].startswith(("extern:", "input:"))]
            for y in list(o["outputs"]):
                same = [x for x in real if tensors[x]["bytes"] == tensors[y]["bytes"]]
                if same:
                    _alias(tensors, alias, y, same[0])
                    o["outputs"].remove(y)
        if o["name"] == "aten::lift_fresh" and len(o["inputs"]) == 1:
            for y in o["outputs"]:
                _alias(tensors, alias, y, o["inputs"][0])
            o["outputs"] = []
        elif (o["name"] == "aten::index_put" and o["phase"] == "backward" and o["inputs"]
              and len(o["outputs"]) == 1 and tensors[o["inputs"][0]]["producer"] == i - 1):
            o["name"] = "aten::_index_put_impl_"
            _alias(tensors, alias, o["outputs"][0], o["inputs"][0])
            o["outputs"] = [o["inputs"][0]]
        elif _accumulates_in_place(ops, tensors, i, first_back, last_back):
            o["name"] = "aten::add_"
            _alias(tensors, alias, o["outputs"][0], o["inputs"][0])
            o["outputs"] = [o["inputs"][0]]
    # A scalar FakeTensorMode keeps alive after an in-place op: an extra output that no op
    # reads (the step-end op lists every tensor alive) and nothing frees.
    read = {x for o in ops if o["name"] != "tidal::step_end" for x in o["inputs"]}
    for i, o in enumerate(ops):
        for y in list(o["outputs"]):
            x = tensors[y]
            if (x["output_slot"] >= 1 and x["producer"] == i and not x["persistent"]
                    and x["freed_after"] < 0 and x["bytes"] <= 64 and y not in read):
                o["outputs"].remove(y)
                alias[y] = -1
    for o in ops:
        if o["name"] == "tidal::step_end":  # each tensor once, as the tracer lists them
            o["inputs"] = list(dict.fromkeys(x for x in o["inputs"] if alias.get(x) != -1))
    return alias


def normalize(trace: dict) -> dict:
    """A trace recorded on fake tensors made into the one the real step records (see the
    module's text); `trace` is the JSON dict of tidal's trace format, changed in place."""
    ops, tensors = trace["ops"], trace["tensors"]
    drop = _fake_only_ops(ops)
    gone = set(_undo_out_of_place(ops, tensors))
    # Ops renumbered without the dropped ones (a dropped op's index maps to the op before it),
    # tensors without those that became others, and the names made of op indices with them.
    op_map, j = [], -1
    for i in range(len(ops)):
        if i not in drop:
            j += 1
        op_map.append(max(j, 0))
    kept = [x for x in tensors if x["id"] not in gone]
    ids = {x["id"]: k for k, x in enumerate(kept)}
    for x in kept:
        x["id"] = ids[x["id"]]
        if x["producer"] >= 0:
            x["producer"] = op_map[x["producer"]]
            if x["name"].startswith("op"):
                x["name"] = f"op{x['producer']}:{x['output_slot']}"
        if x["freed_after"] >= 0:
            x["freed_after"] = op_map[x["freed_after"]]
    new_ops = []
    for i, o in enumerate(ops):
        if i in drop:
            continue
        o["index"] = len(new_ops)
        o["inputs"] = [ids[x] for x in o["inputs"]]
        o["outputs"] = [ids[x] for x in o["outputs"]]
        new_ops.append(o)
    trace["ops"], trace["tensors"] = new_ops, kept
    trace.setdefault("meta", {})["tracer"] = "tidal RecordFunction tracer, on fake tensors"
    return trace


# -- op times ------------------------------------------------------------------------------

def measure_rates(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """FLOP/s of a matrix product and bytes/s of an elementwise op on `device`, measured (a
    tenth of a second or so)."""
    def timed(fn, repeat: int) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) / repeat

    n = 512 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    flops = 2.0 * n ** 3 / max(timed(lambda: a @ b, 3), 1e-9)
    x = torch.randn(4 << 20, device=device)
    y = torch.empty_like(x)
    moved = 3 * x.numel() * x.element_size()  # two reads, one write
    bandwidth = moved / max(timed(lambda: torch.add(x, x, out=y), 5), 1e-9)
    return flops, bandwidth


def model_op_times(trace: dict, flops: float, bandwidth: float, element_bytes: int) -> dict:
    """The trace (a JSON dict) with each op's time from a roofline: its matrix products' FLOPs
    at `flops`, or the bytes it reads and writes at `bandwidth`, whichever is longer, plus a
    small per-op overhead; the ops end to end from 0 (tidal/trace/cost_model.hpp)."""
    timed = json.loads(_C.model_op_times(json.dumps(trace), flops, bandwidth, element_bytes))
    timed.setdefault("meta", {})["op_durations"] = (
        f"cost model: {flops / 1e9:.1f} GFLOP/s, {bandwidth / 1e9:.1f} GB/s")
    return timed


# -- the fake run --------------------------------------------------------------------------


def _fake_copies(model: torch.nn.Module, optimizer, mode):
    """The model and optimizer copied onto fake tensors (one copy: the optimizer's parameters
    are the copied model's)."""
    from torch._subclasses.fake_tensor import FakeCopyMode
    try:
        with FakeCopyMode(mode):
            return copy.deepcopy((model, optimizer))
    except Exception as e:  # noqa: BLE001 - any failure means: profile instead
        raise FakeTraceError(f"the model or optimizer cannot be copied onto fake tensors "
                             f"({type(e).__name__}: {e})") from e


def _why(e: Exception) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"the step cannot run on fake tensors ({type(e).__name__}: {first})"


def trace_step(model: torch.nn.Module, optimizer, step: StepFn, session_kwargs: dict,
               fake_mode=None) -> tuple[dict, dict, Optional[int]]:
    """Step 0's and step 1's traces of `step(model, optimizer)`, run on fake copies under a
    session made with `session_kwargs` (the real session's options), normalized; and the size
    of the pieces its optimizer step was split into (None: not split). With `fake_mode`, the
    model and optimizer are already fake tensors of that mode (built under it): they are run
    as they are."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from .session import Session
    if fake_mode is not None:
        mode, fake_model, fake_opt = fake_mode, model, optimizer
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        # The step's real inputs (the batch it closes over) become fake tensors where they
        # first meet a fake op, a storage the real step does not make: an untraced step on a
        # scratch copy converts them first (the mode keeps the conversions).
        try:
            with mode:
                step(*_fake_copies(model, optimizer, mode))
        except FakeTraceError:
            raise
        except Exception as e:  # noqa: BLE001 - the op fake tensors could not run, said
            raise FakeTraceError(_why(e)) from e
        fake_model, fake_opt = _fake_copies(model, optimizer, mode)
    session = Session(model=fake_model, optimizer=fake_opt, _fake=True, **session_kwargs)
    try:
        with mode:
            for _ in range(2):
                with session.step():
                    step(fake_model, fake_opt)
        traces = [normalize(json.loads(t))
                  for t in session._live().recorded_iterations_json()]
        pieces = session._split._piece_bytes
    except _C.Error:
        raise
    except Exception as e:  # noqa: BLE001 - the op fake tensors could not run, said
        raise FakeTraceError(_why(e)) from e
    finally:
        session.close()
    if len(traces) != 2:
        raise FakeTraceError(f"the fake run recorded {len(traces)} steps, not 2")
    # A fake tensor's storage is on the meta device; the trace is of the device it trains on.
    first_param = next(iter(model.parameters()), None)
    device = str(first_param.device) if first_param is not None else "cpu"
    for t in traces:
        for x in t["tensors"]:
            if x["device"] == "meta":
                x["device"] = device
        if t.get("device") == "meta":
            t["device"] = device
    return traces[0], traces[1], pieces
