"""tidal.Session: the C++ tidal::torch_layer::Session, around the steps of a Python loop."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from . import _C
from ._options import Size, parse_budget, parse_size, store_options
from ._stats import traffic
from . import _fsdp
from ._hooks import _Hook, _unwatch_torch_save, _watch_torch_save
# Models pickled while a session was open by a tidal whose hooks lived in this module name
# them tidal.session._inert_hook (and, pickled again once loaded, tidal.session._inert): those
# names stay here, so such checkpoints still load.
from ._hooks import _inert, _inert_hook  # noqa: F401
from ._optimizer_split import OptimizerSplit, join_groups
from .distributed import prepare_model
from .host_step import HostStep, optimizer_on_host
from . import fake_trace
from .fake_trace import StepFn


@dataclasses.dataclass(frozen=True)
class SessionStats:
    """What the session did in the last step, and overall (tidal::torch_layer::SessionStats).

    Byte counts are ints, times are seconds. `str(stats)` is one line for a progress bar. The
    fields are those the binding returns, by name (tests/python/test_stats_fields.py).
    """

    mode: str
    state: str  # "off", "warmup", "profiling", "executing"
    bytes_written: int
    bytes_read: int
    bytes_to_host: int
    bytes_from_host: int
    bytes_staged: int  # read from the SSD store into the host pool ahead of a prefetch
    host_stall_seconds: float
    planned_bytes_to_ssd: int
    planned_bytes_to_host: int
    planned_step_seconds: float
    between_steps: str
    stall_seconds: float
    write_stall_seconds: float
    misses: int
    write_failures: int
    store_full_writes: int
    write_error: str
    step_peak: int
    memory_budget: int
    untouched_bytes: int
    profiled_peak: int
    within_budget: bool
    steps_measured: int
    steps_over_budget: int
    steps_aborted: int
    out_of_memory_retries: int
    budget_reason: str
    shapes: int
    shape: int
    replans: int
    tightenings: int
    retimings: int
    planned_ahead: bool
    executed_peak: int
    plan_summary: str
    defaults: str
    notice: str

    def __str__(self) -> str:
        b = _C.format_bytes
        line = f"tidal {self.mode}/{self.state}: peak {b(self.step_peak)}, {traffic(self)}"
        if self.mode == "plan" and self.memory_budget:
            line += (f", budget {b(self.memory_budget)} "
                     f"({'met' if self.within_budget else 'not met yet'})")
        return line


# Optimizer state per parameter byte, for optimizers whose state is not made yet (Adam's comes
# at its first step): the moments they keep.
_STATE_PER_PARAMETER = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                        "Adadelta": 2, "RMSprop": 1, "SGD": 0}


def _state_bytes(model: torch.nn.Module, optimizer) -> int:
    """The model's state before its first step: parameters and buffers, the gradients of those
    that train, and the optimizer's state (what it holds, or what it will make)."""
    params = list(model.parameters())
    total = sum(_fsdp.local_tensor(t).nbytes for t in params)
    total += sum(_fsdp.local_tensor(b).nbytes for b in model.buffers())
    trained = sum(_fsdp.local_tensor(p).nbytes for p in params if p.requires_grad)
    total += trained
    if optimizer is None:
        return total
    held = sum(v.nbytes for state in optimizer.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)
    if held:
        return total + held
    per = _STATE_PER_PARAMETER.get(type(optimizer).__name__, 2)
    if type(optimizer).__name__ == "SGD" and any(g.get("momentum") for g in optimizer.param_groups):
        per = 1
    return total + per * trained


def _refuse_plan_options(mode: str, **given) -> None:
    """Options that only plan mode uses, given to another mode: refused, not ignored."""
    names = [name for name, (value, default) in given.items() if value != default]
    if names:
        one = len(names) == 1
        raise _C.InvalidArgument(
            f"{', '.join(names)} {'is an option' if one else 'are options'} of mode=\"plan\", "
            f"and mode={mode!r} does nothing with {'it' if one else 'them'}: leave "
            f"{'it' if one else 'them'} out, or use mode=\"plan\"")


def _distributed(model) -> bool:
    """A DDP-wrapped model, or one with FSDP2-sharded (DTensor) parameters."""
    if model is None:
        return False
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel) or _fsdp.uses_dtensors(model)


class Session:
    """Offloads a training loop's tensors to SSDs in one of three modes.

    mode: "none" (nothing moves: the reference), "activations" (autograd's saved tensors, the
    SSDTrain/TBA way), or "plan" (profile the first steps, plan every tensor class, execute).
    dirs: one directory per SSD (`{rank}`/`{local_rank}` are replaced; None: TIDAL_DIRS).
    budget: plan mode's memory budget, a share of the profiled peak ("50%", 0.5) or
    whole-process bytes (an int or "8GiB"); by default on a GPU what tensors can hold there
    (measured at start), on the CPU "50%". host_memory: the host tier of plan and activation
    modes ("8GiB"; 0: SSD only); by default on a GPU the memory the process may still take less
    a reserve, on the CPU 0. strict: the wall (below); by default on for a GPU, off on the CPU.
    Before step 0 a plan session with a model says what it chose and whether the model's state
    fits in the budget, host memory and the store together, and refuses to start when it does
    not. The plan-mode options (budget, strict, strict_budget, wall_by_retry, between_steps)
    are refused in the other modes, and host_memory in mode "none": they would do nothing
    there. Only one plan-mode session may be open in a process at a time.
    model, optimizer: their parameters, buffers and optimizer state are registered with their
    names (the session finds such tensors without it; names make the trace and plan readable,
    and in activation mode they are never written as activations).
    device: the device whose memory the budget is about and the meter measures ("cuda:0"); by
    default the model's (its first parameter's), else the CPU. On CUDA the meter reads the
    caching allocator's allocated bytes.
    strict: the strict meter: from the first executed step on (from step 0 with a budget in
    bytes), an allocation that would take the process over the budget first has tensors the
    running op does not read written out, and when none is left raises torch.OutOfMemoryError,
    as a GPU with that much memory would. On CUDA the budget becomes the caching allocator's
    memory fraction (it counts reserved memory), and an op refused memory is run again once
    tensors are written out. wall_by_retry: raise the CPU's wall that way too (tests the GPU's
    path on a CPU).
    timeline_steps: the steps the timeline keeps (the last ones; 0: none): what ran, each transfer
    on its channel, stalls and memory against the budget (write_timeline), and where the time
    went (time_report). timeline: a file to write it to when the session closes (a Chrome trace
    for Perfetto, or an SVG picture for a name ending in .svg).
    optimizer_step: where the optimizer's step runs: "device" (as written), or "host"
    (tidal.host_step: the optimizer's parameters become host copies of the model's, its state and
    the gradients live in host memory, outside the budget; the step is the user's optimizer run
    there, bit-identical to it run on the host without tidal). "host" needs `optimizer`.

    Create it before the model when you can: the memory meter counts tensors allocated after
    `import tidal`, and the session's own meter after its creation.

    Use `with session.step():` around forward, backward and the optimizer step, or
    `begin_step()` / `end_step()`. Call it from the thread that runs the loop.
    `close()` (or leaving `with tidal.Session(...) as session:`) ends it: every tensor it moved
    comes back into memory, and its store's files and disk reservation are given back; an
    optimizer_step="host" stays on the host (`session.host_step.remove()` moves it back).
    Errors raise tidal.Error (tidal.InvalidArgument for a bad option, tidal.IoError for a failing
    store) with the C++ message.
    """

    def __init__(self,
                 mode: str = "plan",
                 dirs: Optional[Union[str, Sequence[str]]] = None,
                 budget: Optional[Union[int, float, str]] = None,
                 host_memory: Optional[Size] = None,
                 model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 *,
                 capacity: Optional[Size] = None,
                 min_bytes: Optional[Size] = None,
                 warmup_steps: int = 1,
                 profile_steps: int = 2,
                 retime_steps: int = 4,
                 strict_budget: bool = False,
                 strict: Optional[bool] = None,
                 wall_by_retry: bool = False,
                 between_steps: str = "auto",
                 adaptive: bool = True,
                 checksum: bool = True,
                 hardware: str = "cpu-here",
                 name: str = "",
                 device: Optional[Union[str, torch.device]] = None,
                 timeline_steps: int = 2,
                 timeline: Optional[str] = None,
                 optimizer_step: str = "device",
                 plan_ahead: Optional[StepFn] = None,
                 _faults: Optional[dict] = None,
                 _fake: bool = False) -> None:
        if mode != "plan":
            tiers = {"host_memory": (host_memory, None)} if mode == "none" else {}
            _refuse_plan_options(mode, budget=(budget, None), **tiers,
                                 strict=(strict, None), strict_budget=(strict_budget, False),
                                 wall_by_retry=(wall_by_retry, False),
                                 between_steps=(between_steps, "auto"))
        Session._check_optimizer_step(optimizer_step, model, optimizer)
        ahead = None
        if plan_ahead is not None:
            Session._check_plan_ahead(mode, model, optimizer_step)
            ahead = Session._trace_ahead(model, optimizer, plan_ahead, dict(
                mode="plan", dirs=dirs, budget=budget, min_bytes=min_bytes,
                between_steps=between_steps, hardware=hardware, name=name, device=device))
        opt = _C.SessionOptions()
        opt.mode = mode
        # The device whose memory the budget is about and the meter measures: given, or the
        # model's (its first parameter's), else the CPU.
        if device is None and model is not None:
            first = next(iter(model.parameters()), None)
            device = first.device if first is not None else None
        opt.device = str(torch.device(device if device is not None else "cpu"))
        if mode != "none":
            opt.store = store_options(dirs, capacity, checksum, _faults)
        if budget is not None:  # else the device's default (SessionOptions.memory_budget)
            opt.memory_budget, opt.budget_fraction = parse_budget(budget)
        self._split = OptimizerSplit(opt.memory_budget)  # the optimizer step's pieces
        opt.budget_option = "Session(budget=...)"
        opt.between_steps_option = "Session(between_steps=\"offloaded\")"
        if host_memory is not None:  # else the machine's default
            opt.host_memory = parse_size(host_memory, "host_memory")
        if min_bytes is not None:
            b = parse_size(min_bytes, "min_bytes")
            act = opt.activations
            act.min_bytes = b
            opt.activations = act
            opt.executor_min_bytes = b
        act = opt.activations
        act.adaptive = adaptive
        opt.activations = act
        opt.warmup_steps = warmup_steps
        opt.profile_steps = profile_steps
        opt.retime_steps = retime_steps
        opt.strict_budget = strict_budget
        if strict is not None:  # else on for a GPU, off on the CPU
            opt.strict_meter = strict
        opt.wall_by_retry = wall_by_retry
        if between_steps == "auto" and _distributed(model):
            # DDP's and FSDP2's collectives read parameters and gradients as raw buffers, which
            # no hook brings back from the SSD: their step boundary stays resident.
            between_steps = "resident"
        if mode == "plan":
            opt.between_steps = between_steps
        opt.hardware = hardware
        opt.model_name = name or (type(model).__name__ if model is not None else "")
        if timeline_steps < 0:
            raise _C.InvalidArgument(f"timeline_steps is {timeline_steps}: give 0 (no timeline) "
                                     "or the number of steps to keep")
        opt.timeline_steps = timeline_steps
        opt.timeline_path = os.fspath(timeline) if timeline is not None else ""
        self._session = _C.Session(opt)
        self._hooks: list = []  # handles of the hooks this session put on the model and optimizer
        self._mode = mode
        self._model = model
        self._optimizer = optimizer
        self._registered: set[int] = set()
        self._param_names: dict[int, str] = {}
        self._in_step = False
        self._restore_groups = lambda: None  # _split_multi_tensor_steps sets it
        self._host_step = optimizer_on_host(optimizer) if optimizer_step == "host" else None
        if model is not None:
            prepare_model(model, mode, self._session)
            self._fsdp = _fsdp.prepare(self._session, model, optimizer, mode)
            for n, p in model.named_parameters():
                self._param_names[id(p)] = n
                self._register(p, n, "parameter")
            for n, b in model.named_buffers():
                self._register(b, n, "parameter")
        self._register_optimizer()
        if mode == "plan":
            # With the step on the host, its state is not the device's.
            if not _fake:
                self._preflight(model, optimizer if self._host_step is None else None)
            self._hook_state_dicts(model, optimizer)
            if (optimizer is not None and self._host_step is None
                    and hasattr(optimizer, "register_step_pre_hook")):
                self._split_multi_tensor_steps(optimizer)
            if ahead is not None:
                first, steady, self._split._piece_bytes = ahead
                self._session.plan_ahead(json.dumps(first), json.dumps(steady))

    @staticmethod
    def _check_optimizer_step(where: str, model, optimizer) -> None:
        """optimizer_step: "device", or "host" with an optimizer the host step takes."""
        if where not in ("device", "host"):
            raise _C.InvalidArgument(f"optimizer_step={where!r}: give \"device\" (the step as "
                                     "written) or \"host\" (the step on host copies)")
        if where == "device":
            return
        if optimizer is None:
            raise _C.InvalidArgument("optimizer_step=\"host\" needs the optimizer: "
                                     "Session(..., optimizer=opt, optimizer_step=\"host\")")
        if _distributed(model):
            raise _C.InvalidArgument(
                "optimizer_step=\"host\" with DDP or FSDP2 is not supported yet (their "
                "collectives read the gradients on the device): use FSDP2's CPUOffloadPolicy, "
                "or optimizer_step=\"device\"")

    @staticmethod
    def _check_plan_ahead(mode: str, model, optimizer_step: str) -> None:
        if mode != "plan":
            raise _C.InvalidArgument(f"plan_ahead is for plan mode (mode={mode!r}): it plans "
                                     "the model's tensors before step 0")
        if model is None:
            raise _C.InvalidArgument("plan_ahead needs the model: Session(model=model, "
                                     "optimizer=optimizer, plan_ahead=step)")
        if optimizer_step != "device":
            raise _C.InvalidArgument("plan_ahead with optimizer_step=\"host\" is not "
                                     "supported yet: leave plan_ahead out (the session "
                                     "profiles its first steps)")

    @staticmethod
    def _trace_ahead(model, optimizer, step: StepFn, kwargs: dict):
        """Step 0's and a later step's traces from a fake run of `step` (fake_trace), with op
        times from the cost model; None, said, when the step cannot run on fake tensors."""
        kwargs.update(warmup_steps=0, profile_steps=3, retime_steps=0, strict=False,
                      host_memory=0, timeline_steps=0, capacity="64MiB", checksum=False)
        try:
            first, steady, pieces = fake_trace.trace_step(model, optimizer, step, kwargs)
        except fake_trace.FakeTraceError as e:
            print(f"tidal: plan_ahead: {e}; the session profiles its first steps instead",
                  file=sys.stderr)
            return None
        first_param = next(iter(model.parameters()), None)
        dtype = first_param.dtype if first_param is not None else torch.float32
        device = first_param.device if first_param is not None else torch.device("cpu")
        flops, bandwidth = fake_trace.measure_rates(device, dtype)
        element = torch.empty((), dtype=dtype).element_size()
        first, steady = (fake_trace.model_op_times(t, flops, bandwidth, element)
                         for t in (first, steady))
        return first, steady, pieces

    def _preflight(self, model, optimizer) -> None:
        # Before step 0: the choices left to the machine, and whether the model's state fits in
        # the budget, host memory and the store together (said in one line, refused if not).
        defaults = self._session.stats()["defaults"]
        if defaults:
            print(f"tidal: {defaults}", file=sys.stderr)
        if model is None:
            return
        check = self._session.preflight(_state_bytes(model, optimizer))
        print(f"tidal: {check['line']}", file=sys.stderr)
        if not check["fits"]:
            session, self._session = self._session, None
            session.close()
            if self._host_step is not None:  # the optimizer is the user's again
                self._host_step.remove()
                self._host_step = None
            raise _C.InvalidArgument(check["line"])

    def _hook_state_dicts(self, model, optimizer) -> None:
        # With the step boundary offloaded, the model's state may be on the SSD between steps:
        # state_dict() (and so torch.save of it) reads raw bytes, so it brings them back first.
        hook = _Hook(self, Session._resident_between_steps)
        if model is not None:
            self._hooks.append(model.register_state_dict_pre_hook(hook))
        if optimizer is not None and hasattr(optimizer, "register_state_dict_pre_hook"):
            self._hooks.append(optimizer.register_state_dict_pre_hook(hook))
        _watch_torch_save(self)

    def _resident_between_steps(self, *_args, **_kwargs) -> None:
        if not self._in_step and self._session is not None:
            self._session.make_resident()

    def _split_multi_tensor_steps(self, optimizer) -> None:
        # A foreach or fused group larger than a piece of the budget steps in pieces
        # (OptimizerSplit), joined again after the step.
        self._hooks.append(optimizer.register_step_pre_hook(_Hook(self, Session._split_groups)))
        self._hooks.append(optimizer.register_step_post_hook(_Hook(self, Session._after_step)))
        self._restore_groups = lambda: join_groups(optimizer, checked=False)

    def _split_groups(self, opt, _args, _kwargs) -> None:
        self._split.split(opt, self._measured_budget)

    def _measured_budget(self) -> int:
        return self._session.stats()["memory_budget"] if self._session is not None else 0

    def _after_step(self, opt, _args, _kwargs) -> None:
        join_groups(opt, checked=True)

    # -- the session's life -----------------------------------------------------------------

    def _live(self):
        if self._session is None:
            raise _C.Error("this tidal.Session was closed (make a new one to offload again)")
        return self._session

    def close(self) -> None:
        """Ends the session: every tensor it moved comes back into memory, its hooks come off
        the model and optimizer, and its store's files and disk reservation are given back.
        stats() still answers. Call it between steps; calling it again does nothing. A DDP model
        keeps the communication hook plan mode installed (DDP cannot remove one): it holds the
        store until the model goes. A host optimizer step stays on the host: the device may not
        hold its state (host_step.remove() moves it back)."""
        if self._session is None:
            return
        if self._in_step:
            raise _C.Error("close() inside a step: end the step first (end_step(), or leave "
                           "`with session.step():`)")
        self._restore_groups()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        _unwatch_torch_save(self)
        session, self._session, self._fsdp = self._session, None, None
        session.close()
        self._final_stats = SessionStats(**session.stats())
        self._closed = session  # its timeline and report still answer

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *_exc) -> None:
        if self._in_step:  # an exception left a step open: end it, keep the exception
            self.abort_step()
        self.close()

    # -- steps ------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A step starts (forward, backward and the optimizer step follow)."""
        self._register_optimizer()
        # A step that raised inside optimizer.step() left its groups split: put them back.
        self._restore_groups()
        self._live().begin_step()
        self._in_step = True

    def end_step(self) -> None:
        """The step's ops have run. Plan mode may plan here. Raises tidal.IoError when a tensor
        cannot be read back."""
        self._in_step = False
        self._live().end_step()

    def abort_step(self) -> None:
        """Ends a step that raised: the session learns nothing from it (no profile, re-plan or
        tightening of the wall), the tensors it moved come back as at a step's end, and the
        next step starts under the wall the user set. `with session.step():` calls it when an
        exception leaves the block. Does nothing outside a step."""
        if not self._in_step:
            return
        self._in_step = False
        self._restore_groups()
        self._live().abort_step()

    @contextlib.contextmanager
    def step(self) -> Iterator["Session"]:
        """`with session.step():` around one training step. An exception that leaves the block
        aborts the step (abort_step) and goes on."""
        self.begin_step()
        try:
            yield self
        except BaseException:
            # The step's own error wins; the session is still closed for the next step.
            try:
                self.abort_step()
            except _C.Error:
                pass
            raise
        self.end_step()

    def phase(self, name: str) -> None:
        """Optional: the step enters "forward", "backward" or "optimizer" (labels the trace;
        starts activation prefetching at "backward")."""
        self._live().begin_phase(name)

    def make_resident(self) -> None:
        """Plan mode with between_steps="offloaded": bring every moved tensor back now (before
        code that reads raw bytes, e.g. torch.save)."""
        self._live().make_resident()

    # -- what it did ------------------------------------------------------------------------

    @property
    def host_step(self) -> Optional[HostStep]:
        """The optimizer step on the host (optimizer_step="host"): its host_bytes() and
        parameters_per_second(); None otherwise."""
        return self._host_step

    def stats(self) -> SessionStats:
        if self._session is None and getattr(self, "_final_stats", None) is not None:
            return self._final_stats  # a closed session's last word
        return SessionStats(**self._live().stats())

    def time_report(self) -> dict:
        """Where the time of the kept executed steps went, per step: compute_seconds (inside
        ops, less their stalls), between_ops_seconds (the loop's own code, data), read stalls by
        channel, write_stall_seconds (the budget), bytes by channel beside the plan's, misses,
        evictions, and "limit": one sentence saying what limits the run and what would help.
        "text" is the report as `tidal train` prints it. steps == 0: nothing kept yet."""
        return self._reporter().time_report()

    def write_timeline(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Writes the timeline of the kept steps: a Chrome trace (open it in ui.perfetto.dev or
        chrome://tracing) with the ops, a lane per I/O channel, stalls on the ops they delayed,
        memory against the budget and the plan's deadlines; or, for a name ending in .svg, a
        picture of memory over the last step, measured and planned, with the I/O under it."""
        self._reporter().write_timeline(os.fspath(path))

    def _reporter(self):
        return self._session if self._session is not None else getattr(self, "_closed", None) \
            or self._live()

    def store_stats(self) -> Optional[dict]:
        """The store's counters since it opened (None in mode "none")."""
        return self._live().store_stats()

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def trace(self) -> Optional[dict]:
        """Plan mode: the profiled trace in use (docs/trace-format.md), None before planning."""
        text = self._live().trace_json()
        return None if text is None else json.loads(text)

    @property
    def plan(self) -> Optional[dict]:
        """Plan mode: the plan in use (docs/plan-format.md), None before planning."""
        text = self._live().plan_json()
        return None if text is None else json.loads(text)

    def trace_json(self) -> Optional[str]:
        return self._live().trace_json()

    def plan_json(self) -> Optional[str]:
        return self._live().plan_json()

    # -- registration -----------------------------------------------------------------------

    def _register(self, t: Any, name: str, cls: str) -> None:
        if not isinstance(t, torch.Tensor) or id(t) in self._registered:
            return
        self._registered.add(id(t))
        self._live().register_persistent(_fsdp.local_tensor(t).detach(), name, cls)

    def _register_optimizer(self) -> None:
        # Adam's state is made at its first step: looked for again at every step's start. With
        # the step on the host, that state is host memory: not the device's to register.
        if self._optimizer is None or self._host_step is not None:
            return
        for i, (p, state) in enumerate(self._optimizer.state.items()):
            base = self._param_names.get(id(p), f"param{i}")
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    self._register(value, f"{base}.{key}", "optimizer_state")

    def __repr__(self) -> str:
        if self._session is None:
            return f"tidal.Session(mode={self._mode!r}, closed)"
        return f"tidal.Session(mode={self._mode!r}, state={self.stats().state!r})"
