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

import torch  # noqa: F401  (first: the extension links libtorch_python, loaded by torch)

from . import _C
from ._C import Error, InvalidArgument, IoError, format_bytes, parse_bytes
from .activations import ActivationStats, offload_activations
from .session import Session, SessionStats

__all__ = [
    "ActivationStats",
    "Error",
    "InvalidArgument",
    "IoError",
    "Session",
    "SessionStats",
    "format_bytes",
    "memory_stats",
    "offload_activations",
    "parse_bytes",
    "reset_peak_memory",
]


def memory_stats() -> dict:
    """CPU tensor memory counted since `import tidal`: current_bytes, peak_bytes (since the last
    reset_peak_memory()), allocations, frees."""
    return _C.memory_stats()


def reset_peak_memory() -> None:
    """Restarts the peak of memory_stats() from the bytes held now."""
    _C.reset_peak_memory()


_C.memory_stats()  # installs the meter now, before the model's tensors exist
