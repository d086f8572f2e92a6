"""tidal with torch.distributed: what plan mode needs from DistributedDataParallel."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def overlapping_allreduce_hook(session: Any):
    """A DDP communication hook for plan mode: DDP's own averaging (divide, then all-reduce, as
    torch's default allreduce_hook), asynchronous as DDP's default, with the bucket held in
    memory while the backend reduces it.

    DDP's all-reduce runs in the backend's thread while backward goes on, on the flat gradient
    bucket, a tensor the plan executor sees idle between the copies into it and out of it. The
    hook holds the bucket in the session (the executor neither writes it out nor frees it, and
    cancels a write in flight) from before the reduction starts to the end of the step (DDP
    copies the reduced bucket into the gradients when backward ends, after every future), so
    communication keeps overlapping backward and no thread writes a tensor the executor moved.
    """

    def hook(process_group, bucket):  # no annotation: DDP checks it against its own types
        group = process_group if process_group is not None else dist.group.WORLD
        tensor = bucket.buffer()
        session.hold(tensor)
        tensor.div_(group.size())
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def prepare_model(model: torch.nn.Module, mode: str, session: Any) -> None:
    """Plan mode on a DDP model: installs overlapping_allreduce_hook (DDP allows one hook; a
    model with its own must hold the bucket in the session while its collective runs)."""
    from torch.nn.parallel import DistributedDataParallel

    if mode != "plan" or not isinstance(model, DistributedDataParallel):
        return
    model.register_comm_hook(state=None, hook=overlapping_allreduce_hook(session))
