"""tidal from Python: offload training tensors to SSDs, over tidal's C++ core.

    import tidal
    with tidal.offload_activations(dirs=["/mnt/nvme0"]):       # activations only
        loss = model(x).sum()
    session = tidal.Session(mode="plan", dirs=["/mnt/nvme0"], budget="50%",
                            model=model, optimizer=opt)         # every tensor class
    with session.step():
        ...forward, backward, opt.step()...
    print(session.stats())

docs/python.md has the details. Importing tidal installs tidal's CPU memory meter (a tracking
allocator): tensors allocated from then on are counted by memory_stats() and the sessions.
"""

import contextlib

import torch  # noqa: F401  (first: the extension links libtorch_python, loaded by torch)

from . import _C
from ._C import Error, InvalidArgument, IoError, format_bytes, parse_bytes
from .activations import ActivationStats, offload_activations
from .estimate import Estimate, estimate
from .host_step import HostStep, optimizer_on_host
from .session import Session, SessionStats

__all__ = [
    "ActivationStats",
    "Error",
    "Estimate",
    "HostStep",
    "InvalidArgument",
    "IoError",
    "Session",
    "SessionStats",
    "estimate",
    "format_bytes",
    "memory_cap",
    "memory_stats",
    "offload_activations",
    "optimizer_on_host",
    "parse_bytes",
    "reset_peak_memory",
]


def memory_stats() -> dict:
    """CPU tensor memory counted since `import tidal`: current_bytes, peak_bytes (since the last
    reset_peak_memory()), allocations, frees, the strict meter's refusals and reclaimed_bytes
    (memory_cap), and host_bytes and host_peak_bytes: host memory on the CPU (the host step's),
    outside the others."""
    return _C.memory_stats()


@contextlib.contextmanager
def memory_cap(budget):
    """The strict meter, for the block: a CPU allocation that would take the process's tensor
    memory (memory_stats()["current_bytes"]) past `budget` (bytes, or a size such as "512MiB")
    raises torch.OutOfMemoryError, as it would on a GPU with that much memory. The previous cap
    comes back after, unless the block changed it. A Session(strict=True) sets it to its budget
    by itself."""
    bytes_ = parse_bytes(budget) if isinstance(budget, str) else int(budget)
    if bytes_ <= 0:
        raise InvalidArgument("memory_cap needs a positive budget, such as '512MiB'")
    previous = _C.memory_cap()
    _C.set_memory_cap(bytes_)
    try:
        yield bytes_
    finally:
        # Unless something changed the cap since (a session's make_resident() lifts its wall):
        # putting `previous` back then would restore a wall its session no longer holds.
        if _C.memory_cap() == bytes_:
            _C.set_memory_cap(previous)


def reset_peak_memory() -> None:
    """Restarts the peak of memory_stats() from the bytes held now."""
    _C.reset_peak_memory()


_C.memory_stats()  # installs the meter now, before the model's tensors exist
