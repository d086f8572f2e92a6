"""tidal.offload_activations: autograd's saved tensors to SSDs, as a context manager."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

from . import _C
from ._options import Size, parse_size, store_options
from ._stats import traffic


@dataclasses.dataclass(frozen=True)
class ActivationStats:
    """The last finished step (tidal::torch_layer::ActivationStats). The fields are those the
    binding returns, by name (tests/python/test_stats_fields.py)."""

    packed: int
    offloaded: int
    kept_small: int
    kept_parameter: int
    kept_adaptive: int
    deduplicated: int
    forwarded: int
    prefetched: int
    misses: int
    write_failures: int
    store_full: int
    write_error: str
    cancelled_writes: int
    bytes_written: int
    bytes_to_host: int  # of bytes_written, to the host tier (0 in this context: SSD only)
    bytes_read: int
    stall_seconds: float
    forward_seconds: float
    passes: int
    keep_from: int
    lookahead_bytes: int

    def __str__(self) -> str:
        return (f"tidal activations: {self.offloaded} of {self.packed} saved tensors offloaded, "
                f"{traffic(self)}")


class offload_activations:
    """Offloads the tensors autograd saves inside the block to the SSD store, and reads them back,
    prefetched, during backward (tidal's C++ ActivationOffloader: deduplication, forwarding of
    tensors still being written, prefetch, adaptive keep). Losses and gradients are bit-identical
    to training without it.

        offload = tidal.offload_activations(dirs=["/mnt/nvme0"], min_bytes="1MiB")
        for x, y in data:
            with offload:
                loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
        offload.close()

    A step runs from one `with` to the next (or to end_step()/close()): backward reads the
    tensors back after the block, so the step's store space is freed when the next block starts.
    Run backward before the next `with`; several forwards of one step (a GAN) go in one block.
    One offloader can be active per process. Parameters (leaves that require grad) stay in
    memory; pass `model` to keep its buffers too.
    """

    def __init__(self,
                 dirs: Optional[Union[str, Sequence[str]]] = None,
                 min_bytes: Size = "1MiB",
                 *,
                 capacity: Optional[Size] = None,
                 lookahead: Size = "32MiB",
                 adaptive: bool = True,
                 checksum: bool = True,
                 model: Optional[torch.nn.Module] = None,
                 _faults: Optional[dict] = None) -> None:
        ao = _C.ActivationOptions()
        ao.min_bytes = parse_size(min_bytes, "min_bytes")
        ao.lookahead_bytes = parse_size(lookahead, "lookahead")
        ao.adaptive = adaptive
        self._offloader = _C.ActivationOffloader(store_options(dirs, capacity, checksum, _faults), ao)
        self._open = False
        self._closed_stats: Optional[dict] = None  # the last step's, kept by close()
        self._closed_store: Optional[dict] = None
        self._closed_notice = ""
        if model is not None:
            self._offloader.keep_storages_of(
                [t.detach() for t in list(model.parameters()) + list(model.buffers())])

    def __enter__(self) -> "offload_activations":
        if self._offloader is None:
            raise _C.Error("offload_activations was closed; make a new one")
        self.end_step()
        self._offloader.begin_step()
        self._open = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        # The step stays open: backward, after the block, reads the offloaded tensors back.
        return False

    def end_step(self) -> None:
        """Ends the open step: waits for its I/O and frees its store space. Backward of that
        step must have run (a graph kept past it can no longer be unpacked)."""
        if self._open:
            self._open = False
            self._offloader.end_step()

    def close(self) -> None:
        """Ends the open step and closes the store."""
        if self._offloader is not None:
            self.end_step()
            self._closed_stats = self._offloader.last_step()
            self._closed_store = self._offloader.store_stats()
            self._closed_notice = self._offloader.notice()
            self._offloader = None

    def stats(self) -> ActivationStats:
        """Counters of the last finished step (also after close())."""
        if self._offloader is None:
            return ActivationStats(**(self._closed_stats or {}))
        return ActivationStats(**self._offloader.last_step())

    def store_stats(self) -> dict:
        """The store's counters since it opened (bytes_written, bytes_read, ...); after close(),
        those it had when it closed."""
        if self._offloader is None:
            return dict(self._closed_store or {})
        return self._offloader.store_stats()

    @property
    def notice(self) -> str:
        """Empty, or why offloading stopped paying (the adaptive rule keeps everything)."""
        if self._offloader is None:
            return self._closed_notice
        return self._offloader.notice()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
