"""Store failures inside autograd's hooks and the plan executor's op callbacks reach Python as
exceptions carrying tidal's message, never as a crash; the process goes on training."""

import pytest
import torch

import tidal
from conftest import batches, make_mlp, wait_for_writes


def test_corrupt_activation_read_raises_in_backward(store_dir):
    # The first read from the store comes back with a flipped byte: the checksum catches it.
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes=0, capacity="64MiB",
                                        adaptive=False, _faults={"corrupt_read": 1})
    a = torch.randn(512, 512, requires_grad=True)
    with offload:
        loss = a.exp().sin().sum()  # sin saves exp's result, which only autograd holds
    wait_for_writes(offload, 1)  # backward must read the tensor back from the store
    with pytest.raises(RuntimeError, match="checksum mismatch"):
        loss.backward()
    offload.close()
    # Training goes on without tidal.
    a.exp().sum().backward()
    assert torch.equal(a.grad, a.detach().exp())


def test_failing_reads_in_plan_mode_raise_and_leave_the_process_usable(store_dir):
    model = make_mlp(seed=6, width=512)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    # Every read fails with EIO from the first one on (a dying disk): the first executed step
    # that needs a tensor back fails in the op that needs it, or in end_step.
    session = tidal.Session(mode="plan", dirs=[store_dir], budget="50%", capacity="256MiB",
                            min_bytes="64KiB", model=model, optimizer=opt,
                            between_steps="offloaded",
                            _faults={"fail_op": 1, "only_reads": True, "fail_every_after": True})
    raised = None
    for x, y in batches(seed=7, steps=6):
        try:
            with session.step():
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        except RuntimeError as e:  # tidal.Error is a RuntimeError too
            raised = e
            break
    assert raised is not None, session.stats()
    # The store's message, naming the read and the injected errno: not any failure at all.
    assert isinstance(raised, tidal.IoError) or "tensor store read" in str(raised), repr(raised)
    assert "tensor store read" in str(raised) and "Input/output error" in str(raised), raised
    del session
    torch.ones(4).add_(1)  # the process is fine
