"""What the statistics of a step share in their one-line form."""

from __future__ import annotations

from typing import Any

from . import _C


def traffic(stats: Any) -> str:
    """A step's SSD traffic and the time it waited for reads, for `str(stats)` of an
    ActivationStats or a SessionStats: "wrote 1.0 MiB, read 1.0 MiB, stall 0.012 s"."""
    b = _C.format_bytes
    return (f"wrote {b(stats.bytes_written)}, read {b(stats.bytes_read)}, "
            f"stall {stats.stall_seconds:.3f} s")
