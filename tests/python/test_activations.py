"""tidal.offload_activations: bit-identical training, bytes through the store."""

import time

import pytest
import torch

import tidal
from conftest import batches, train_mlp, wait_for_writes

STEPS = 4


def train(data, forward_ctx=None):
    """Losses and final weights of Adam on the MLP; forward inside `forward_ctx` when given."""
    losses, params, _ = train_mlp(data, seed=1, offload=forward_ctx)
    return losses, params


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


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_python_backward_with_checkpointing_is_bit_identical(store_dir, reentrant):
    """Python's loss.backward() runs PyTorch's Python engine, not the C++ one tidal's C++ hooks
    are installed on; saved tensors still go through the store, also with activation
    checkpointing (reentrant: its recomputation saves tensors inside backward; non-reentrant:
    torch's own saved-tensor hooks come first)."""
    from torch.utils.checkpoint import checkpoint

    g = torch.Generator().manual_seed(7)
    data = [torch.randn(64, 256, generator=g).requires_grad_() for _ in range(3)]

    def run(offload=None):
        torch.manual_seed(0)
        blocks = torch.nn.ModuleList([torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
            for _ in range(3)])
        opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
        losses = []
        for x in data:
            opt.zero_grad()

            def forward():
                h = x
                for b in blocks:
                    h = b(h) if reentrant is None else checkpoint(b, h, use_reentrant=reentrant)
                return h.pow(2).mean()

            if offload is None:
                loss = forward()
            else:
                with offload:
                    loss = forward()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    ref = run()
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes=0, capacity="64MiB",
                                        adaptive=False)
    got = run(offload)
    offload.end_step()
    store = offload.store_stats()
    offload.close()
    assert got == ref
    assert store["bytes_written"] > 0 and store["bytes_read"] > 0


def test_double_backward_through_offloaded_tensors(store_dir):
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(8), requires_grad=True)
    ref = x.detach().clone().requires_grad_(True)
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes=0, capacity="64MiB",
                                        adaptive=False)
    with offload:
        y = (x.tanh() * x.sin()).sum()
    (gx,) = torch.autograd.grad(y, x, create_graph=True)
    gx.pow(2).sum().backward()
    offload.end_step()
    written = offload.store_stats()["bytes_written"]
    offload.close()
    y2 = (ref.tanh() * ref.sin()).sum()
    (g2,) = torch.autograd.grad(y2, ref, create_graph=True)
    g2.pow(2).sum().backward()
    assert torch.equal(x.grad, ref.grad)
    assert written > 0
