"""torch.compile: activation offloading works on a compiled model (bit-identical, bytes through
the store); plan mode refuses it with the reason before any tensor is offloaded."""

import pytest
import torch

import tidal
from conftest import batches, loop_step, reference_run

STEPS = 4


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.Tanh(),
        torch.nn.Linear(512, 10))


def train(data, session_args=None, offload=None):
    """Losses and final weights of Adam on the compiled model, with a Session (session_args) or
    an offload_activations context (offload) when given."""
    model = make_model(seed=3)
    compiled = torch.compile(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = None
    if session_args is not None:
        session = tidal.Session(model=model, optimizer=opt, **session_args)
    losses = []
    for x, y in data:
        losses.append(loop_step(compiled, opt, x, y, session, offload).item())
    return losses, [p.detach().clone() for p in model.parameters()], session


@pytest.fixture(scope="module")
def reference():
    return reference_run(train, seed=4, steps=STEPS)


def test_offload_activations_of_a_compiled_model_is_bit_identical(reference, store_dir):
    data, ref_losses, ref_params = reference
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes="16KiB", capacity="64MiB",
                                        adaptive=False)
    losses, params, _ = train(data, offload=offload)
    offload.end_step()
    stats, store = offload.stats(), offload.store_stats()
    offload.close()
    assert losses == ref_losses
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    # The compiled function's saved tensors went through the store and came back.
    assert stats.offloaded > 0
    assert store["bytes_written"] > 0 and store["bytes_read"] > 0


def test_session_activation_mode_on_a_compiled_model_is_bit_identical(reference, store_dir):
    data, ref_losses, ref_params = reference
    losses, params, session = train(
        data, session_args=dict(mode="activations", dirs=[store_dir], min_bytes="16KiB",
                                capacity="64MiB"))
    assert losses == ref_losses
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)


def test_plan_mode_refuses_a_compiled_model_before_offloading_anything(reference, store_dir):
    data, ref_losses, _ = reference
    with pytest.raises(tidal.InvalidArgument, match="torch.compile") as err:
        train(data, session_args=dict(mode="plan", dirs=[store_dir], budget="50%",
                                      min_bytes=0, capacity="64MiB"))
    assert "activation" in str(err.value)  # says what to use instead
    # The refused session (still alive through `err`'s traceback) stopped tracing: a new plan
    # session in this process profiles and executes.
    model = make_model(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = tidal.Session(mode="plan", dirs=[store_dir], budget="60%", min_bytes=0,
                            capacity="64MiB", model=model, optimizer=opt)
    for x, y in data:
        with session.step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert session.stats().state == "executing"


def test_a_compiled_step_after_the_plan_runs_right_then_is_refused(store_dir):
    """The plan executes on the eager model; then the loop switches to the compiled one. That
    step runs with every tensor brought back (same loss as without tidal), and the next plan is
    refused with the reason."""
    data = batches(seed=5, steps=10)

    def run(with_tidal):
        model = make_model(seed=6)
        compiled = torch.compile(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        session = None
        if with_tidal:
            session = tidal.Session(mode="plan", dirs=[store_dir], budget="60%", min_bytes=0,
                                    capacity="64MiB", model=model, optimizer=opt)
        losses, states, error = [], [], None
        for i, (x, y) in enumerate(data):
            fn = model if i < 6 else compiled
            if session:
                session.begin_step()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(fn(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if session:
                try:
                    session.end_step()
                except tidal.InvalidArgument as e:
                    error = e
                    break
                states.append(session.stats().state)
        return losses, states, error

    ref, _, _ = run(False)
    losses, states, error = run(True)
    assert "executing" in states[:6], states
    assert losses == ref[:len(losses)]
    assert len(losses) >= 7  # the first compiled step ran, with the right loss
    assert error is not None and "torch.compile" in str(error)
