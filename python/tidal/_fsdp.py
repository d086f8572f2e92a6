"""tidal with FSDP2 (torch.distributed.fsdp.fully_shard): what plan mode needs.

FSDP2 touches tensors in two ways the plan executor cannot see:

1. It frees and re-allocates each unsharded parameter (the all-gather output) with
   `UntypedStorage.resize_(0)` / `resize_(n)`, which call ATen's resize directly, outside the
   dispatcher: no op the tracer records, no residency guard. The plan saw those buffers as
   persistent 1 MiB inputs, offloaded one after its last use in backward, and FSDP freed the
   memory under the write in flight: SIGSEGV in the store's checksum (TensorStore::Impl::hash,
   src/io/store/) on the I/O thread, "checksum mismatch" on reading it back, or "Attempted to call
   resize_() on an invalid python storage" when the write had already nulled the storage.
   route_storage_resizes() makes FSDP2 resize through `torch.ops.inductor.resize_storage_bytes_`
   (the same resize, as an op): the tracer first sees these buffers at 0 bytes, so the plan
   never moves them, and the guard sees every resize.

2. Parameters, gradients and optimizer state are DTensors. From torch 2.10 on, DTensor ops are
   dispatched in C++ (dispatchDTensorOp -> get_local_results), which calls the kernel of the
   local shard directly: the residency guard does not run for the local tensor, and the tracer
   records only the DTensor op, on the DTensor's own storage (no data, the global size). A local
   shard the plan had moved was then read at a null pointer (SIGSEGV in the optimizer step,
   fault address 0x20). The optimizer step is where such ops run (FSDP itself works on the
   local tensors with ordinary ops): OptimizerHold holds every local shard the step reads or
   writes (parameters, gradients, optimizer state) in memory from the step's start to its end
   (Session.hold / release: a write in flight is finished, a moved tensor read back, and no
   planned move touches it meanwhile). DTensor ops elsewhere in a loop (gradient clipping on
   DTensor gradients) need the same: hold the tensors around them.

local_tensor() is what the session registers for a DTensor (its shard, with the bytes it
holds), not the DTensor itself, whose storage has no data and the global size.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional

import torch

_routed = False


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return None
    return DTensor


def local_tensor(t: Any) -> Any:
    """A DTensor's local shard (the tensor whose bytes this rank holds); anything else as is."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return t._local_tensor
    return t


def uses_dtensors(model: Optional[torch.nn.Module]) -> bool:
    """True when the model's parameters are DTensors (FSDP2, tensor parallelism)."""
    dtensor = _dtensor_type()
    if model is None or dtensor is None:
        return False
    return any(isinstance(p, dtensor) for p in model.parameters())


def route_storage_resizes() -> bool:
    """FSDP2 frees and re-allocates its unsharded parameters through
    torch.ops.inductor.resize_storage_bytes_ (an op: traced and guarded) instead of
    UntypedStorage.resize_ (invisible). Same bytes, same results. Process-wide, once; False
    when this torch has no such FSDP2 internals (nothing changed)."""
    global _routed
    if _routed:
        return True
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        return False
    resize = getattr(getattr(torch.ops, "inductor", None), "resize_storage_bytes_", None)
    if resize is None or not hasattr(_fsdp_param, "free_storage") \
            or not hasattr(_fsdp_param, "alloc_storage"):
        return False

    def free_storage(tensor: torch.Tensor) -> None:
        if tensor.untyped_storage().size() != 0:
            torch.ops.inductor.resize_storage_bytes_(tensor, 0)

    def alloc_storage(tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.itemsize
        if tensor.untyped_storage().size() != size:
            torch.ops.inductor.resize_storage_bytes_(tensor, size)

    _fsdp_param.free_storage = free_storage
    _fsdp_param.alloc_storage = alloc_storage
    _routed = True
    return True


class OptimizerHold:
    """Holds the local shards an optimizer step reads and writes (DTensor parameters, their
    gradients and state) in the session for the duration of each `optimizer.step()`, through
    the optimizer's step pre- and post-hooks. A step that raises leaves them held until the
    next step's end."""

    def __init__(self, session: Any, optimizer: torch.optim.Optimizer) -> None:
        self._session = session
        self._optimizer = optimizer
        self._held: List[torch.Tensor] = []
        self._handles = [optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post)]

    def _locals(self) -> Iterator[torch.Tensor]:
        dtensor = _dtensor_type()
        for group in self._optimizer.param_groups:
            for p in group["params"]:
                if not isinstance(p, dtensor):
                    continue
                state = self._optimizer.state.get(p, {})
                for t in [p, p.grad, *state.values()]:
                    if isinstance(t, dtensor):
                        yield t._local_tensor

    def _pre(self, *_: Any) -> None:
        self._post()
        for t in self._locals():
            self._session.hold(t)
            self._held.append(t)

    def _post(self, *_: Any) -> None:
        held, self._held = self._held, []
        for t in held:
            self._session.release(t)

    def remove(self) -> None:
        self._post()
        for h in self._handles:
            h.remove()
        self._handles = []


def prepare(session: Any, model: Optional[torch.nn.Module],
            optimizer: Optional[torch.optim.Optimizer], mode: str) -> Optional[OptimizerHold]:
    """Plan mode on a model with DTensor parameters (FSDP2): routes FSDP2's storage resizes
    through an op and holds the optimizer step's local shards. `session` is the C++ session
    (tidal._C.Session, with hold/release)."""
    if mode != "plan" or not uses_dtensors(model):
        return None
    route_storage_resizes()
    if optimizer is None:
        return None
    if not hasattr(session, "hold"):
        raise RuntimeError("tidal plan mode with DTensor parameters needs Session.hold/release "
                           "(a tidal._C built from this source)")
    return OptimizerHold(session, optimizer)
