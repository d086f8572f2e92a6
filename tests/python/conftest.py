"""Shared fixtures of the Python tests: a store directory on a real disk, a small model."""

import gc
import os
import shutil
import tempfile
import time

import pytest
import torch

import tidal  # noqa: F401  (before any model: the memory meter counts from here)

# Store directories go where the C++ tests put them: a real disk, not tmpfs.
STORE_ROOT = os.environ.get("TIDAL_TEST_DIR", "/var/tmp/tidal")


@pytest.fixture(autouse=True)
def no_cap_left_behind():
    """A session under the strict meter lifts its cap when it goes: one kept alive past its test
    (by a traceback, say) would fail every later test with out of memory. The test that left it
    fails instead, and the cap comes off."""
    yield
    if tidal._C.memory_cap() != 0:
        gc.collect()
    if tidal._C.memory_cap() != 0:
        tidal._C.set_memory_cap(0)
        pytest.fail("the strict meter's cap was still on after this test")


@pytest.fixture
def store_dir():
    os.makedirs(STORE_ROOT, exist_ok=True)
    d = tempfile.mkdtemp(prefix="pytest-", dir=STORE_ROOT)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_mlp(seed: int, width: int = 1024) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.GELU(),
        torch.nn.Linear(width, width), torch.nn.Tanh(),
        torch.nn.Linear(width, 10))


def forward_loss(model, x, y, offload=None) -> torch.Tensor:
    """Cross entropy of model(x) against y. With `offload` (an offload_activations context) the
    forward pass runs inside it, and some of its writes finish before this returns, so that
    backward reads from the store."""
    if offload is None:
        return torch.nn.functional.cross_entropy(model(x), y)
    writes = offload.store_stats()["writes"]
    with offload:
        loss = torch.nn.functional.cross_entropy(model(x), y)
    wait_for_writes(offload, writes + 1)
    return loss


def loop_step(model, opt, x, y, session=None, offload=None) -> torch.Tensor:
    """One step of an ordinary loop: zero_grad, forward_loss (inside `offload` when given),
    backward, opt.step(), between the session's begin_step() and end_step() when a session is
    given. Returns the loss."""
    if session is not None:
        session.begin_step()
    opt.zero_grad()
    loss = forward_loss(model, x, y, offload)
    loss.backward()
    opt.step()
    if session is not None:
        session.end_step()
    return loss


def train_mlp(data, session=None, seed: int = 3, device=None, before_step=None, after_step=None,
              offload=None, **adam):
    """make_mlp(seed) trained with Adam on `data`, an ordinary loop; `session` is a
    tidal.Session or a function (model, optimizer) -> Session, called once the model exists.
    `device`: where the model goes; `before_step`/`after_step`: called around each step (a
    GPU test's peak meter); `offload`: an offload_activations context for the forward passes.
    Returns the losses (a tensor), the final parameters and the session's stats after each
    step."""
    model = make_mlp(seed=seed)
    if device is not None:
        model = model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **adam)
    if callable(session):
        session = session(model, opt)
    losses, stats = [], []
    for x, y in data:
        if before_step is not None:
            before_step()
        loss = loop_step(model, opt, x, y, session, offload)
        if session is not None:
            stats.append(session.stats())
        if after_step is not None:
            after_step()
        losses.append(loss.detach().clone())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], stats


def batches(seed: int, steps: int, batch: int = 128):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(steps)]


def reference_run(train, seed: int, steps: int):
    """batches(seed, steps) and what train(data) gives on them without tidal: the data, the
    losses and the final parameters."""
    data = batches(seed=seed, steps=steps)
    losses, params, _ = train(data)
    return data, losses, params


def wait_for_writes(offload, at_least: int, seconds: float = 10.0) -> None:
    """Waits until the offloader's store has completed `at_least` writes (so that backward
    reads from the store rather than from memory, also on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while offload.store_stats()["writes"] < at_least and time.monotonic() < deadline:
        time.sleep(0.005)
