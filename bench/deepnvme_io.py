"""One round of DeepSpeed's DeepNVMe (the async I/O op under ZeRO-Infinity's NVMe offload):
write SIZE bytes from a page-locked CPU tensor to one file in DIR with O_DIRECT, read them back,
verify every byte, print GB/s as one JSON line. Used by bench/vs_deepspeed.sh, which runs the
same I/O through tidal's store in alternating rounds.

    python bench/deepnvme_io.py --dir DIR --size BYTES --block BYTES --depth Q [--threads N]
    python bench/deepnvme_io.py --build-only

The I/O has the shape of tidal's `bench-io --block B --stripe B --depth Q`: requests of B bytes,
Q in flight, on one file. DeepNVMe's handle is made with block_size=B, queue_depth=Q,
single_submit=False, overlap_events=True (its default in ds_io) and intra_op_parallelism=N
(default 1: one libaio context keeps the Q requests in flight).

The file is created and preallocated before the timed write (as the store preallocates its
file when it opens), so both sides overwrite allocated blocks. DeepNVMe does not check the
results of its completions (a failed or short request is not reported), so the bytes are
verified here: the read lands in a second page-locked tensor filled with a poison byte first,
and every byte is compared with the source after the timed read.
"""

import argparse
import json
import os
import sys
import time


def timed_transfer(handle, what: str, op: str, tensor, path: str) -> float:
    """handle.<op>(tensor, path) and the wait for it: its seconds. Exits saying what failed
    unless the op returned 0 and the wait one completion."""
    t0 = time.perf_counter()
    rc = getattr(handle, op)(tensor, path)
    done = handle.wait()
    seconds = time.perf_counter() - t0
    if rc != 0 or done != 1:
        sys.exit(f"DeepNVMe {what}: {op} returned {rc}, wait() {done} (want 0 and 1)")
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir")
    ap.add_argument("--size", type=int)
    ap.add_argument("--block", type=int)
    ap.add_argument("--depth", type=int)
    ap.add_argument("--threads", type=int, default=1, help="DeepNVMe intra_op_parallelism")
    ap.add_argument("--seed", type=int, default=0x7FDA1)
    ap.add_argument("--data", choices=("random", "repeat"), default="random",
                    help="random: every byte random; repeat: --depth random blocks repeated "
                         "(the shape of tidal bench-io's data)")
    ap.add_argument("--build-only", action="store_true",
                    help="JIT-build (or load) DeepNVMe's async_io op and exit")
    a = ap.parse_args()

    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=True):
        sys.exit("DeepNVMe's async_io op cannot be built here: it needs libaio-dev "
                 "(apt-get install -y libaio-dev), ninja and the Python headers")
    aio = builder.load(verbose=False)
    if a.build_only:
        print(json.dumps({"deepspeed_async_io": "ok", "torch": torch.__version__}))
        return
    for name in ("dir", "size", "block", "depth"):
        if getattr(a, name) is None:
            ap.error(f"--{name} is required")
    if a.size % a.block or a.block % 4096:
        sys.exit("--size must be whole --block's and --block a multiple of 4096 (O_DIRECT)")
    if a.size % (a.threads * 4096):
        sys.exit("--size must split into --threads parts of whole 4 KiB blocks")

    handle = aio.aio_handle(a.block, a.depth, False, True, a.threads)
    example = torch.empty(0, dtype=torch.uint8)
    src = handle.new_cpu_locked_tensor(a.size, example)
    dst = handle.new_cpu_locked_tensor(a.size, example)
    gen = torch.Generator().manual_seed(a.seed)
    # Random bytes, made in 64 MiB pieces (one tensor of int64s the size of the buffer would
    # take 8x its memory).
    piece = 64 << 20 if a.data == "random" else a.block * a.depth
    for off in range(0, a.size, piece):
        n = min(piece, a.size - off)
        if a.data == "random" or off == 0:
            src[off:off + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
        else:
            src[off:off + n].copy_(src[:n])
    dst.fill_(0xA5)

    path = os.path.join(a.dir, f"deepnvme_bench.{os.getpid()}")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, a.size)
        os.close(fd)
        fd = -1

        write_s = timed_transfer(handle, "write", "async_pwrite", src, path)
        read_s = timed_transfer(handle, "read", "async_pread", dst, path)

        verified = bool(torch.equal(src, dst))
    finally:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(path):
            os.remove(path)
        handle.free_cpu_locked_tensor(src)
        handle.free_cpu_locked_tensor(dst)

    print(json.dumps({
        "write_gbps": a.size / write_s / 1e9,
        "read_gbps": a.size / read_s / 1e9,
        "write_seconds": write_s,
        "read_seconds": read_s,
        "verified": verified,
        "bytes": a.size,
        "block": a.block,
        "depth": a.depth,
        "threads": a.threads,
        "direct": True,
        "verify": "every byte, after the timed read, into a poisoned buffer",
    }))
    sys.exit(0 if verified else 3)


if __name__ == "__main__":
    main()
