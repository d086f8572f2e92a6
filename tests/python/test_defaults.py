"""The machine's defaults and the pre-flight (issue 45), on the CPU: the CPU's explicit defaults
(50% of the profiled peak, no wall, no host tier), said in stats().defaults; a model whose state
fits nowhere refused before step 0; one that fits told where its state goes. The GPU's choices
are tested from faked figures in tests/common/memory_defaults_test.cpp."""

import pytest
import torch

import tidal
from conftest import batches, make_mlp, train_mlp


def test_the_cpu_keeps_its_documented_defaults(store_dir, capfd):
    model = make_mlp(seed=1, width=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with tidal.Session(mode="plan", dirs=[store_dir], model=model, optimizer=opt) as session:
        options = session._session.options()
        assert options.memory_budget == 0 and options.budget_fraction == 0.5
        assert options.strict_meter is False
        assert options.host_memory == 0
        assert "50%" in session.stats().defaults
    err = capfd.readouterr().err
    assert "tidal: budget 50%" in err and "pre-flight" in err


def test_given_options_are_kept_and_not_reported_as_defaults(store_dir):
    with tidal.Session(mode="plan", dirs=[store_dir], budget="4MiB", strict=False,
                       host_memory="1MiB") as session:
        options = session._session.options()
        assert options.memory_budget == 4 << 20 and options.strict_meter is False
        assert options.host_memory == 1 << 20
        assert session.stats().defaults == ""


def test_a_model_whose_state_fits_nowhere_is_refused_before_step_0(store_dir):
    # A 256-wide MLP with AdamW: about 3.3 MiB of state (weights, gradients, two moments)
    # against a 256 KiB budget, no host memory and a 1 MiB store.
    model = make_mlp(seed=1, width=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(tidal.InvalidArgument, match="does not fit in the device budget"):
        tidal.Session(mode="plan", dirs=[store_dir], budget="256KiB", host_memory=0,
                      capacity="1MiB", model=model, optimizer=opt)
    # The refusal left no session behind: another can be made at once.
    tidal.Session(mode="plan", dirs=[store_dir]).close()


def test_the_preflight_says_where_a_state_larger_than_the_budget_goes(store_dir, capfd):
    model = make_mlp(seed=1, width=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    weights = sum(p.nbytes for p in model.parameters())
    with tidal.Session(mode="plan", dirs=[store_dir], budget=weights, host_memory="2MiB",
                       capacity="64MiB", model=model, optimizer=opt) as session:
        check = session._session.preflight(4 * weights)
    assert check["fits"]
    assert check["outside_bytes"] == 3 * weights
    assert check["to_host"] == 2 << 20 and check["to_ssd"] == 3 * weights - (2 << 20)
    assert check["transfer_seconds"] > 0
    assert "lives outside the device" in capfd.readouterr().err


def test_activation_mode_writes_saved_tensors_to_host_memory_first(store_dir):
    # The host tier in activation mode: saved tensors go to host memory while it has room and
    # to the SSD store after; either way every loss is the one of training without tidal.
    data = batches(seed=3, steps=6)
    ref_losses, ref_params, _ = train_mlp(data, None, seed=3)

    def run(host):
        return train_mlp(data, lambda m, o: tidal.Session(
            mode="activations", dirs=[store_dir], host_memory=host, min_bytes="64KiB",
            adaptive=False, model=m, optimizer=o), seed=3)

    losses, params, stats = run("256MiB")  # room for every saved tensor of a step
    assert torch.equal(losses, ref_losses)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    moved = [s for s in stats if s.bytes_written > 0]
    assert moved, "nothing was offloaded: the test would prove nothing"
    assert all(s.bytes_to_host == s.bytes_written for s in moved)
    losses, _, stats = run("1MiB")  # room for two of them: the rest to the SSDs
    assert torch.equal(losses, ref_losses)
    assert any(0 < s.bytes_to_host < s.bytes_written for s in stats), [
        (s.bytes_to_host, s.bytes_written) for s in stats]

