"""Two ranks on gloo, launched with the env:// variables (as torchrun would): with activation
offloading and in plan mode every rank's losses equal its losses without tidal, bit for bit."""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(script, out_dir, args_of, world=2, timeout=120):
    """Runs `script` (in this folder) as `world` ranks with the env:// variables torchrun sets;
    `args_of(out)` gives a rank's arguments, `out` the JSON file in `out_dir` it writes. Returns
    each rank's JSON, after asserting that every rank exited 0 (with its output when not)."""
    port = free_port()
    procs, outs = [], []
    for rank in range(world):
        out = os.path.join(out_dir, f"result-{rank}.json")
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), *args_of(out)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed (exit {p.returncode}):\n{logs[rank]}"
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def launch(kind, store_dir, world=2, timeout=120):
    return launch_ranks("ddp_worker.py", store_dir, lambda out: [kind, store_dir, out], world,
                        timeout)


def check(results):
    assert [r["rank"] for r in results] == [0, 1]
    dirs = set()
    for r in results:
        ref = r["none"]["losses"]
        assert len(ref) == 6
        for mode in ("activations", "plan"):
            got = r[mode]
            assert got["losses"] == ref, f"rank {r['rank']} {mode}: {got['losses']} != {ref}"
            assert got["dir_exists"]
            dirs.add(got["dir"])
        assert r["plan"]["state"] == "executing"
        assert r["plan"]["bytes_written"] > 0
    assert len(dirs) == 4  # two modes x two ranks, no directory shared
    # The ranks trained on different data: they are two real ranks, not one run twice.
    assert results[0]["none"]["losses"] != results[1]["none"]["losses"]


def test_ddp_two_ranks_bit_identical(store_dir):
    check(launch("ddp", store_dir))


def test_ddp_plan_mode_overlapping_allreduce_twenty_runs_bit_identical(store_dir):
    """DDP in plan mode without a hook that waits for each all-reduce: 20 runs per rank, each
    bit-identical to DDP without tidal."""
    results = launch("ddp-repeat", store_dir, timeout=400)
    for r in results:
        ref = r["none"]["losses"]
        assert len(r["runs"]) == 20
        same = sum(run["losses"] == ref for run in r["runs"])
        assert same == 20, f"rank {r['rank']}: {same} of 20 runs bit-identical"
        assert all(run["state"] == "executing" and run["bytes_written"] > 0 for run in r["runs"])
    assert results[0]["none"]["losses"] != results[1]["none"]["losses"]
