"""tidal.offload_activations: bit-identical training, bytes through the store."""

import time

import pytest
import torch

import tidal
from conftest import batches, make_mlp, wait_for_writes

STEPS = 4


def train(data, forward_ctx=None):
    """Losses and final weights of Adam on the MLP; forward inside `forward_ctx` when given."""
    model = make_mlp(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for x, y in data:
        opt.zero_grad()
        if forward_ctx is None:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        else:
            writes = forward_ctx.store_stats()["writes"]
            with forward_ctx:
                loss = torch.nn.functional.cross_entropy(model(x), y)
            # Some writes finish before backward, so that it reads from the store.
            wait_for_writes(forward_ctx, writes + 1)
        loss.backward()
        opt.step()
        losses.append(loss.detach().clone())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


def test_context_manager_is_bit_identical_and_uses_the_store(store_dir):
    data = batches(seed=2, steps=STEPS)
    ref_losses, ref_params = train(data)
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes="64KiB", capacity="256MiB")
    losses, params = train(data, offload)
    offload.end_step()
    last = offload.stats()
    store = offload.store_stats()
    offload.close()
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    # Saved activations of 128 x 1024 floats (512 KiB) went to the SSD and came back.
    assert last.packed > 0
    assert store["bytes_written"] > 0
    assert store["bytes_read"] > 0
    assert last.kept_parameter > 0  # weights never go to the store
    # The counters outlive the store: a loop that closes first and reports after still can.
    assert offload.stats() == last
    assert offload.store_stats()["bytes_written"] == store["bytes_written"]


def test_no_offloading_once_the_step_ended(store_dir):
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes=0, capacity="64MiB",
                                        adaptive=False)
    a = torch.randn(256, 256, requires_grad=True)
    with offload:
        b = a.exp()
    wait_for_writes(offload, 1)
    b.sum().backward()
    offload.end_step()
    assert offload.stats().offloaded >= 1
    written = offload.store_stats()["bytes_written"]
    assert written >= 256 * 256 * 4
    c = a.exp()  # no step open: saved in memory as without tidal
    time.sleep(0.05)
    c.sum().backward()
    assert offload.store_stats()["bytes_written"] == written
    offload.close()


def test_inplace_change_of_an_offloaded_tensor_raises(store_dir):
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes=0, capacity="64MiB",
                                        adaptive=False)
    a = torch.randn(256, 256, requires_grad=True)
    with offload:
        b = a.exp()  # exp saves its result
        b.add_(1)  # changes what backward needs
    # The unpack hook's tidal::Error crosses autograd's engine: a Python exception, not a crash.
    with pytest.raises(RuntimeError, match="inplace operation"):
        b.sum().backward()
    offload.close()


def test_python_saved_tensors_hooks_still_work_after_tidal_installed_its_engine(store_dir):
    offload = tidal.offload_activations(dirs=[store_dir], capacity="64MiB")
    offload.close()
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    a = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        b = a.exp()
    b.sum().backward()
    assert packed, "torch.autograd.graph.saved_tensors_hooks was bypassed"
    assert torch.equal(a.grad, a.detach().exp())
