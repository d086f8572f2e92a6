"""The optimizer step on the host: the optimizer's parameters become host copies of
the model's, with their gradients and the optimizer's state in host memory; the device keeps the
model's parameters (on a CPU device, a gradient only until autograd has finished it).

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    host = tidal.optimizer_on_host(opt)          # or Session(..., optimizer_step="host")
    for x, y in data:
        loss_fn(model(x), y).backward()          # (CPU device) each gradient goes to the host
        opt.step()                               # the step runs on the host copies, then the
        opt.zero_grad()                          # model's parameters are written from them
    host.remove()                                # the optimizer is the user's again

The step is the user's own optimizer, run on CPU tensors of the same dtype as the parameters:
its arithmetic is what the same optimizer does on the CPU, so a run is bit-identical to the
same loop with its optimizer on the host and nothing offloaded (on a CPU device, to the plain
loop). Gradients of several backward passes before a step add up on the host, as autograd adds
them up in `.grad`. On a CPU device "host memory" is tidal's meter's host scope (_C.host_memory):
outside the device's budget and never moved by a plan, as a GPU machine's RAM would be; `.grad`
is then the host copy's gradient. Beside a GPU, `.grad` stays on the device as without the host
step, and step() copies it to pinned host memory first.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Optional

import torch

from . import _C


def _on_cpu_device(p: torch.Tensor) -> bool:
    return p.device.type == "cpu"


def _host_memory(cpu_device: bool):
    return _C.host_memory() if cpu_device else contextlib.nullcontext()


def _host_empty_like(p: torch.Tensor) -> torch.Tensor:
    """Host memory for a copy of `p`, same shape, strides and dtype (pinned beside a GPU)."""
    cpu_device = _on_cpu_device(p)
    with _host_memory(cpu_device):
        return torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device="cpu",
                                   pin_memory=not cpu_device and torch.cuda.is_available())


class _Entry:
    """One parameter: the model's tensor on the device and its host copy (the optimizer's)."""

    __slots__ = ("param", "master", "hook")

    def __init__(self, param: torch.Tensor, master: torch.Tensor) -> None:
        self.param = param
        self.master = master
        self.hook = None


def _own_method(opt, name: str):
    """(rebind, callable): the optimizer's own attribute `name` (None: the class's method);
    rebind: it is a method bound to `opt`, kept as its function and bound again at each call."""
    own = opt.__dict__.get(name)
    if own is not None and getattr(own, "__self__", None) is opt:
        return True, own.__func__
    return False, own


class _GradientHook:
    """A parameter's post-accumulate-grad hook: the step's _gradient_made for its entry, while
    the step lives (held weakly)."""

    __slots__ = ("_step", "_index")

    def __init__(self, step_ref, index: int) -> None:
        self._step = step_ref
        self._index = index

    def __call__(self, _param) -> None:
        step = self._step()
        if step is not None and self._index < len(step._entries):
            step._gradient_made(step._entries[self._index])


class HostStep:
    """The optimizer step of `optimizer` on the host (see the module's doc). Made by
    optimizer_on_host(); `remove()` gives the optimizer its parameters back, with its state
    moved to their device."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if getattr(optimizer, "_tidal_host_step", None) is not None:
            raise _C.InvalidArgument("this optimizer's step is on the host already "
                                     "(optimizer_on_host was called on it before)")
        # Held weakly, as the hooks on the parameters hold the step: the optimizer holds the
        # step (its wrapped methods), so no cycle keeps the model's tensors alive once the user
        # drops model and optimizer.
        self._optimizer_ref = weakref.ref(optimizer)
        self._entries: list[_Entry] = []
        self._copied = None  # the event after the last step's copies to the device
        self.step_seconds = 0.0  # time in the optimizer's own step, over all steps
        self.steps = 0
        self.parameters_stepped = 0  # parameters (elements) the steps updated, over all steps
        for group in optimizer.param_groups:
            group["params"] = [self._adopt(p) for p in group["params"]]
        self._move_state(lambda e: e.param, lambda e: e.master)
        # What step() and zero_grad() were before: the class's, or an attribute set on the
        # optimizer (an LR scheduler's wrapper), kept without a strong reference back to it.
        self._inner = {name: _own_method(optimizer, name) for name in ("step", "zero_grad")}
        optimizer.step = self.step
        optimizer.zero_grad = self.zero_grad
        optimizer._tidal_host_step = self

    def _call_inner(self, name: str, *args, **kwargs):
        opt = self._optimizer
        bound, own = self._inner[name]
        if own is None:
            return getattr(type(opt), name)(opt, *args, **kwargs)
        return own(opt, *args, **kwargs) if bound else own(*args, **kwargs)

    @property
    def _optimizer(self) -> torch.optim.Optimizer:
        opt = self._optimizer_ref()
        if opt is None:
            raise _C.Error("the optimizer of this host step is gone")
        return opt

    # -- set-up ----------------------------------------------------------------------------

    def _adopt(self, p: torch.Tensor) -> torch.Tensor:
        if p.is_sparse or type(p).__name__ == "DTensor" or p.is_meta:
            raise _C.InvalidArgument(
                f"the optimizer step on the host takes dense parameters on one device; this "
                f"optimizer has a {p.layout} {type(p).__name__} on {p.device}: keep its step on "
                "the device (optimizer_step=\"device\")")
        master = _host_empty_like(p)
        with torch.no_grad():
            master.copy_(p)
        entry = _Entry(p, master)
        if p.requires_grad and _on_cpu_device(p):
            entry.hook = p.register_post_accumulate_grad_hook(
                _GradientHook(weakref.ref(self), len(self._entries)))
        self._entries.append(entry)
        return master

    def _move_state(self, source, target) -> None:
        """The optimizer's state, from the key `source(entry)` to `target(entry)`, its tensors
        moved to the target's device (host memory for a master)."""
        state = self._optimizer.state
        for e in self._entries:
            old, new = source(e), target(e)
            if old not in state:
                continue
            values = state.pop(old)
            to_host_scope = new is e.master and _on_cpu_device(e.param)
            with _host_memory(to_host_scope), torch.no_grad():
                state[new] = {k: self._moved(v, new) for k, v in values.items()}

    @staticmethod
    def _moved(v, like: torch.Tensor):
        if not isinstance(v, torch.Tensor) or v.dim() == 0 and v.device.type == "cpu":
            return v  # hyperparameter-like values, and step counters, stay as they are
        return v.to(like.device, copy=True)

    # -- gradients -------------------------------------------------------------------------

    def _gradient_made(self, e: _Entry) -> None:
        """(CPU device) autograd's hook after it added this backward pass's gradient into
        `.grad`: `.grad` becomes the host copy's gradient itself. The next pass adds into it in
        place, as autograd adds into any `.grad`, and code between backward and step (clipping,
        model.zero_grad()) sees and changes it. A `.grad` that is not the host one (the first
        pass, or one after zero_grad) replaces it."""
        g = e.param.grad
        if g is None or g is e.master.grad:
            return
        with _C.host_memory(), torch.no_grad():
            e.master.grad = g.clone()
        e.param.grad = e.master.grad

    def _fetch_gradients(self) -> None:
        """(GPU) Each parameter's `.grad`, as the loop left it (accumulated, clipped), copied into
        its host copy's pinned gradient; none where `.grad` is none. `.grad` stays on the
        device, as without the host step."""
        fetched = False
        with torch.no_grad():
            for e in self._entries:
                g = e.param.grad
                if g is None:
                    e.master.grad = None
                    continue
                if e.master.grad is None:
                    e.master.grad = _host_empty_like(g)
                e.master.grad.copy_(g, non_blocking=True)
                fetched = True
        if fetched:
            torch.cuda.current_stream(self._entries[0].param.device).synchronize()

    # -- the step --------------------------------------------------------------------------

    def step(self, closure=None):
        """The optimizer's step on the host copies, then each parameter it updated copied to
        the device."""
        if closure is not None:
            raise _C.InvalidArgument(
                "optimizer.step(closure) with the step on the host: the closure would run "
                "forward and backward again inside the step; call backward before step() "
                "instead (or keep the step on the device)")
        if self._optimizer.__dict__.get("_tidal_host_step") is not self:
            return self._call_inner("step")  # removed, and patched again on top of ours
        if self._copied is not None:
            self._copied.synchronize()  # the masters are read by last step's copies
        cpu_device = bool(self._entries) and _on_cpu_device(self._entries[0].param)
        if not cpu_device:
            self._fetch_gradients()
        stepped = [e for e in self._entries if e.master.grad is not None]
        start = time.perf_counter()
        with _host_memory(cpu_device):
            out = self._call_inner("step")
        self.step_seconds += time.perf_counter() - start
        self.steps += 1
        self.parameters_stepped += sum(e.master.numel() for e in stepped)
        with torch.no_grad():
            for e in stepped:
                e.param.copy_(e.master, non_blocking=not cpu_device)
        if not cpu_device and stepped and torch.cuda.is_available():
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(stepped[0].param.device))
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """optimizer.zero_grad(): the host copies' gradients, and the model's `.grad` that
        shares them."""
        self._call_inner("zero_grad", set_to_none=set_to_none)
        for e in self._entries:
            if e.param.grad is None or e.param.grad is e.master.grad:
                if e.master.grad is None:
                    e.param.grad = None
            elif set_to_none:  # a GPU's own .grad, as the optimizer would clear it
                e.param.grad = None
            else:
                e.param.grad.zero_()

    # -- what it holds ---------------------------------------------------------------------

    def host_bytes(self) -> int:
        """Bytes of host memory the step holds: copies, their gradients and the optimizer's
        state."""
        total = 0
        for e in self._entries:
            total += e.master.nbytes + (e.master.grad.nbytes if e.master.grad is not None else 0)
        for values in self._optimizer.state.values():
            total += sum(v.nbytes for v in values.values() if isinstance(v, torch.Tensor))
        return total

    def parameters_per_second(self) -> Optional[float]:
        """Parameters the optimizer's own steps updated per second of their time (None before a
        step)."""
        if self.step_seconds <= 0:
            return None
        return self.parameters_stepped / self.step_seconds

    def remove(self) -> None:
        """The optimizer's parameters are the model's again, its state moved to their device,
        and any gradient not yet stepped moved back into `.grad`. Call it between steps."""
        opt = self._optimizer
        if opt.__dict__.get("_tidal_host_step") is not self:
            return
        if self._copied is not None:
            self._copied.synchronize()
        swap = {id(e.master): e.param for e in self._entries}
        for group in opt.param_groups:
            group["params"] = [swap.get(id(m), m) for m in group["params"]]
        self._move_state(lambda e: e.master, lambda e: e.param)
        with torch.no_grad():
            for e in self._entries:
                if e.hook is not None:
                    e.hook.remove()
                if e.master.grad is not None and e.param.grad is e.master.grad:
                    e.param.grad = e.master.grad.to(e.param.device, copy=True)
        for name in ("step", "zero_grad"):
            if getattr(opt.__dict__.get(name), "__self__", None) is self:
                del opt.__dict__[name]
        opt._tidal_host_step = None
        self._entries.clear()


def optimizer_on_host(optimizer: torch.optim.Optimizer) -> HostStep:
    """Runs `optimizer`'s step on the host from now on (see tidal.host_step's doc): its
    parameters become host copies of the model's, its state moves to host memory, gradients go
    to the host (on a CPU device as autograd makes them, beside a GPU at step()), and step()
    writes the updated parameters back to the device. Returns the HostStep; its remove() undoes it."""
    return HostStep(optimizer)
