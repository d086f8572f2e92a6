"""Turning Python arguments into the C++ options: sizes, budgets, store directories per rank."""

from __future__ import annotations

import os
import re
from typing import Iterable, Optional, Sequence, Union

from . import _C

Size = Union[int, str]


def parse_size(value: Size, option: str) -> int:
    """Bytes in `value`: an int, or a string with units parsed by tidal's C++ parser."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _C.InvalidArgument(
            f"{option} must be a byte count (an int) or a size such as '8GiB', "
            f"not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise _C.InvalidArgument(f"{option} must be 0 or more bytes, not {value}")
        return value
    try:
        return _C.parse_bytes(value)
    except _C.Error as e:
        raise _C.InvalidArgument(f"{option}: {e}") from None


def parse_budget(value: Union[int, float, str]) -> tuple[int, float]:
    """(memory_budget bytes, budget_fraction) for Session(budget=...).

    "50%", 0.5 or "0.5": a share of the memory the profiled steps use; 2**30 or "1GiB":
    whole-process bytes. A string that is a bare number with a decimal point means what the
    float does (it was once read as bytes: "0.5" became 1 byte, "0.4" zero).
    """
    if isinstance(value, str) and re.fullmatch(r"\s*(\d+\.\d*|\.\d+)\s*", value):
        value = float(value)
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise _C.InvalidArgument(
                f"budget={value!r}: a fraction must be in (0, 1]; give bytes as an int or a "
                "size such as '8GiB', or a share as '50%'")
        return 0, value
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1]
        try:
            percent = float(text)
        except ValueError:
            percent = -1.0
        if not 0 < percent <= 100:
            raise _C.InvalidArgument(
                f"budget={value!r}: a share must be a percentage in (0, 100], e.g. '50%'")
        return 0, percent / 100.0
    budget = parse_size(value, "budget")
    if budget == 0:
        raise _C.InvalidArgument(
            "budget=0: give the memory budget in bytes (e.g. '8GiB') or a share of the "
            "profiled peak (e.g. '50%')")
    return budget, 0.5


def rank_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size): torch.distributed's when initialised, else the env://
    variables that torchrun and launchers set, else a single process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, local_rank, world


def store_dirs(dirs: Optional[Union[str, Sequence[str]]]) -> list[str]:
    """The store directories of this process.

    `dirs` (or TIDAL_DIRS, comma-separated, when dirs is None) may name `{rank}` and
    `{local_rank}`. In a job of several ranks a directory without a placeholder gets a
    `rank<N>` subdirectory, so that no two ranks share a directory, unless it is one already
    (its last component is this rank's `rank<N>`). Directories made from a placeholder or for a
    rank are created when their parent exists.
    """
    if dirs is None:
        env = os.environ.get("TIDAL_DIRS", "")
        dirs = [d for d in env.split(",") if d]
        if not dirs:
            raise _C.InvalidArgument(
                "no store directory given: pass dirs=['/mnt/nvme0', ...] (one per SSD) or set "
                "TIDAL_DIRS")
    elif isinstance(dirs, (str, os.PathLike)):
        dirs = [os.fspath(dirs)]
    rank, local_rank, world = rank_info()
    out = []
    for d in _as_list(dirs):
        d = os.fspath(d)
        if not d.strip():
            raise _C.InvalidArgument(
                f"dirs={dirs!r} has an empty directory: give one directory per SSD, e.g. "
                "dirs=['/mnt/nvme0/tidal']")
        made = d.replace("{local_rank}", str(local_rank)).replace("{rank}", str(rank))
        own = os.path.basename(made.rstrip("/")) == f"rank{rank}"  # the user's per-rank directory
        if made == d and world > 1 and not own:
            made = os.path.join(d, f"rank{rank}")
        if made != d and os.path.isdir(os.path.dirname(made.rstrip("/")) or "."):
            os.makedirs(made, exist_ok=True)
        out.append(made)
    return out


def _as_list(dirs: Iterable) -> list:
    if isinstance(dirs, (str, bytes)):
        return [dirs]
    return list(dirs)


def store_options(dirs, capacity: Optional[Size], checksum: bool,
                  faults: Optional[dict] = None) -> "_C.StoreOptions":
    """The store's options; `faults` (a test hook) sets fields of io::FaultPlan."""
    so = _C.StoreOptions()
    if faults:
        plan = _C.FaultPlan()
        for k, v in faults.items():
            setattr(plan, k, v)
        so.faults = plan
    so.dirs = store_dirs(dirs)
    if capacity is not None:
        so.capacity = parse_size(capacity, "capacity")
    so.checksum = checksum
    return so
