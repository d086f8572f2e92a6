"""The Python API under random calls: sessions, contexts, steps and backward calls in random
orders with random arguments, good and bad (tests/python/fuzz_worker.py). Each run is its own
process, so that a crash (a signal) or a hang (the time limit) is seen as a failure; the
worker itself checks that errors are clear ones and that every whole training step gives the
loss of training without tidal, bit for bit.

Runs seeds for TIDAL_FUZZ_SECONDS (default 60) in CI; TIDAL_FUZZ_SEED=N reruns one seed. A seed
running past TIDAL_FUZZ_SEED_TIMEOUT seconds (default 120) is a hang; beside another process
that saturates the disk, a seed whose session moves every small tensor (min_bytes=0) under the
strict wall takes minutes (each eviction waits for its write), so runs under load give more."""

import os
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "fuzz_worker.py")
OPS = 80
SEED_TIMEOUT = float(os.environ.get("TIDAL_FUZZ_SEED_TIMEOUT", "120"))


def run_seed(seed: int, store_dir: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    return subprocess.run([sys.executable, WORKER, str(seed), str(OPS), store_dir], env=env,
                          capture_output=True, text=True, timeout=SEED_TIMEOUT)


def test_random_calls_never_crash_hang_or_change_a_loss(store_dir):
    budget = float(os.environ.get("TIDAL_FUZZ_SECONDS", "60"))
    seeds = ([int(os.environ["TIDAL_FUZZ_SEED"])] if "TIDAL_FUZZ_SEED" in os.environ
             else range(1, 10**6))
    deadline = time.monotonic() + budget
    ran = 0
    for seed in seeds:
        try:
            p = run_seed(seed, store_dir)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"seed {seed} hung (over {SEED_TIMEOUT:.0f} s); rerun with "
                        f"TIDAL_FUZZ_SEED={seed}\n"
                        f"{(e.stdout or b'')[-3000:]!r}")
        where = f"seed {seed} (rerun: TIDAL_FUZZ_SEED={seed} pytest {__file__})"
        if p.returncode < 0:
            pytest.fail(f"{where} died of signal {-p.returncode}:\n{p.stdout[-2000:]}\n"
                        f"{p.stderr[-3000:]}")
        assert p.returncode == 0, f"{where} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
        assert "fuzz ok" in p.stdout, f"{where}:\n{p.stdout[-2000:]}"
        ran += 1
        if time.monotonic() > deadline:
            break
    assert ran > 0
    print(f"{ran} seeds ran clean")
