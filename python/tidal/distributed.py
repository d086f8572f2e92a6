"""tidal with torch.distributed: what plan mode needs from DistributedDataParallel."""

from __future__ import annotations

import torch
import torch.distributed as dist


def resident_allreduce_hook(process_group, bucket):
    """A DDP communication hook for plan mode: DDP's own averaging (divide, then all-reduce,
    as torch's default allreduce_hook), but finished before the hook returns.

    DDP's default all-reduce runs in the backend's thread while backward goes on, on the flat
    gradient bucket, a tensor the plan executor sees idle between the copies into it and out of
    it: it could write the bucket to the SSD (or free it) while the backend still reduces it.
    Waiting here means no thread but the training loop's touches the bucket after the hook, so
    every access goes through ops the executor sees. Costs the overlap of gradient communication
    with backward.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    dist.all_reduce(tensor, group=group)  # synchronous
    # An op on the bucket after the reduction (x * 1 is x, bit for bit): the trace shows the
    # bucket in use up to here, so no write of it can start while the backend reduces it.
    tensor.mul_(1)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def prepare_model(model: torch.nn.Module, mode: str) -> None:
    """Plan mode on a DDP model: installs resident_allreduce_hook (DDP allows one hook; a model
    with its own must make its all-reduce finish inside the hook)."""
    from torch.nn.parallel import DistributedDataParallel

    if mode != "plan" or not isinstance(model, DistributedDataParallel):
        return
    model.register_comm_hook(state=None, hook=resident_allreduce_hook)
