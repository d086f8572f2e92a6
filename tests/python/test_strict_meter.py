"""The strict meter: on the CPU a budget is a wall, as a GPU's memory is. An allocation past the
cap raises torch.OutOfMemoryError; plan mode under it runs bit-identical within its budget."""

import gc
import io

import numpy as np
import pytest
import torch

import tidal
from conftest import batches, make_mlp, train_mlp


def train(data, session=None):
    return train_mlp(data, session, seed=11)


def mlp_state_bytes() -> int:
    """The state of train()'s model: parameters, gradients and Adam's two moments."""
    model = make_mlp(seed=11)
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def plan_session(holder, store_dir, **options):
    """A session factory for train(): a plan-mode session under the strict meter, kept in
    `holder["s"]` (with the model and optimizer) so that the test can look at it and end it."""
    def make(model, opt):
        holder["s"] = tidal.Session(mode="plan", dirs=[store_dir], capacity="1GiB",
                                    min_bytes="64KiB", model=model, optimizer=opt, strict=True,
                                    **options)
        holder["model"], holder["opt"] = model, opt
        return holder["s"]
    return make


def test_memory_cap_refuses_past_the_cap_and_comes_off_after():
    a = torch.rand(256, 1024)  # 1 MiB
    held = tidal.memory_stats()["current_bytes"]
    refusals = tidal.memory_stats()["refusals"]
    with tidal.memory_cap(held + 3 * 2**20):
        b = torch.rand(256, 1024)  # fits
        with pytest.raises(torch.OutOfMemoryError, match="strict memory meter"):
            torch.mm(a.t(), a)  # 4 MiB more: past the cap
        assert tidal.memory_stats()["current_bytes"] == held + 2**20, "a refusal holds nothing"
        assert tidal.memory_stats()["refusals"] == refusals + 1
    assert tidal._C.memory_cap() == 0
    assert torch.mm(a.t(), b).shape == (1024, 1024)  # no cap any more
    with pytest.raises(tidal.InvalidArgument):
        with tidal.memory_cap(0):
            pass


def test_plan_mode_under_the_strict_meter_is_bit_identical_within_its_budget(store_dir):
    data = batches(seed=12, steps=9)
    ref_losses, ref_params, _ = train(data)
    refusals = tidal.memory_stats()["refusals"]
    holder = {}

    session = plan_session(holder, store_dir, budget="50%", between_steps="offloaded")

    losses, params, stats = train(data, session)
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    assert tidal.memory_stats()["refusals"] == refusals, "no allocation was refused"
    budget = stats[-1].memory_budget
    assert 0 < budget < stats[-1].profiled_peak
    # Every executed step (the cap was on through each of them) peaked within the budget.
    assert max(s.step_peak for s in stats[3:]) <= budget
    assert tidal._C.memory_cap() == budget  # the session keeps the wall up between steps
    holder.clear()
    gc.collect()
    assert tidal._C.memory_cap() == 0, "the cap goes with its session"


def test_memory_past_the_wall_between_steps_is_an_out_of_memory_error(store_dir):
    data = batches(seed=13, steps=6)
    holder = {}

    session = plan_session(holder, store_dir, budget="50%", between_steps="offloaded")

    train(data, session)
    s = holder["s"]
    budget = s.stats().memory_budget
    assert tidal._C.memory_cap() == budget
    # Code between steps allocating twice the budget: the reclaimer writes out what it can (the
    # model's state may go to the store), and the rest is refused as on a GPU.
    with pytest.raises(torch.OutOfMemoryError, match="strict memory meter"):
        torch.empty(2 * budget, dtype=torch.uint8)
    small = torch.ones(1024)  # what fits still fits
    assert small.sum().item() == 1024
    holder.clear()
    del s
    gc.collect()
    assert tidal._C.memory_cap() == 0, "the cap goes with its session"


def test_a_model_twice_the_budget_trains_within_it_from_step_0(store_dir):
    """The model's state (parameters, gradients, Adam's moments) is about twice the budget:
    with the strict meter and a budget in bytes, the warm-up and profiled steps run under the
    wall too (state written out least recently used first), and every step stays within it."""
    data = batches(seed=14, steps=8)
    state = mlp_state_bytes()
    ref_losses, ref_params, _ = train(data)
    # The budget is for the whole process: what it holds already (the data, the reference run's
    # parameters) plus half the model's state.
    budget = tidal.memory_stats()["current_bytes"] + state // 2
    refusals = tidal.memory_stats()["refusals"]
    holder = {}

    session = plan_session(holder, store_dir, budget=budget, between_steps="offloaded")

    losses, params, stats = train(data, session)
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    assert tidal.memory_stats()["refusals"] == refusals, "no allocation was refused"
    # Every step, step 0 included, within the budget; the warm-up and profiled steps moved
    # state through the store to stay there.
    assert [s.state for s in stats[:3]] == ["warmup", "profiling", "executing"]
    assert all(s.step_peak <= budget for s in stats), [s.step_peak for s in stats]
    assert stats[0].bytes_written > 0 and stats[1].bytes_read > 0
    assert all(s.memory_budget == budget for s in stats)
    holder.clear()
    gc.collect()
    assert tidal._C.memory_cap() == 0


@pytest.mark.parametrize("budget_kind", ["bytes", "share"])
def test_the_wall_raised_as_a_gpu_raises_it(store_dir, budget_kind):
    """wall_by_retry: the cap refuses at once, as the CUDA caching allocator refuses past its
    memory fraction, and nothing frees memory inside the allocation; the residency guard has the
    executor write tensors out and runs the refused op again. The same training bit for bit,
    every step within the budget: from step 0 with a budget in bytes (the model's state is
    twice the budget), from the first executed step with a share."""
    data = batches(seed=15, steps=8)
    state = mlp_state_bytes()
    ref_losses, ref_params, _ = train(data)
    budget = tidal.memory_stats()["current_bytes"] + state // 2 if budget_kind == "bytes" else "50%"
    refusals = tidal.memory_stats()["refusals"]
    holder = {}

    session = plan_session(holder, store_dir, budget=budget, between_steps="offloaded",
                           wall_by_retry=True)

    losses, params, stats = train(data, session)
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    wall = stats[-1].memory_budget
    walled = stats if budget_kind == "bytes" else stats[3:]
    assert all(s.step_peak <= wall for s in walled), ([s.step_peak for s in walled], wall)
    if budget_kind == "bytes":
        # The path was taken: allocations were refused and the refused ops ran again. (With a
        # share, the plan keeps the budget by itself: no refusal need happen.)
        assert tidal.memory_stats()["refusals"] > refusals
        assert stats[-1].out_of_memory_retries > 0
        assert stats[0].bytes_written > 0
    holder.clear()
    gc.collect()
    assert tidal._C.memory_cap() == 0, "the cap goes with its session"


def test_a_wall_under_the_budget_refuses_prefetches_and_training_goes_on(store_dir, capfd):
    """On a GPU the wall counts the caching allocator's reserved memory, which is more than the
    allocated bytes the plan counts: a planned read ahead of its op may be refused although the
    plan has room for it. Here the wall stands 3 MiB under the budget from the first executed
    step, with host memory for offloaded tensors (reads ahead on every op). A refused read is
    held for later (the tensor stays offloaded; the guard reads it when an op needs it): none
    escapes into the profiler's callbacks, which cannot stop an op, and the training is the same
    bit for bit, every step within the wall."""
    data = batches(seed=16, steps=8)
    state = mlp_state_bytes()
    ref_losses, ref_params, _ = train(data)
    budget = tidal.memory_stats()["current_bytes"] + state // 2
    holder = {}
    make = plan_session(holder, store_dir, budget=budget, between_steps="offloaded",
                        wall_by_retry=True, host_memory="64MiB")
    lowered = []

    class Lowered:
        """The session's calls, with the cap lowered before each executed step (the session
        sets it back to the budget when it plans again)."""
        def __init__(self, session):
            self.s = session

        def begin_step(self):
            self.s.begin_step()
            if self.s.stats().state == "executing" or len(lowered) > 0:
                lowered.append(budget - 3 * 2**20)
                tidal._C.set_memory_cap(lowered[-1])

        def __getattr__(self, name):
            return getattr(self.s, name)

    losses, params, stats = train(data, lambda m, o: Lowered(make(m, o)))
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    assert lowered, "no executed step"
    executed = stats[-len(lowered):]
    assert all(s.step_peak <= budget - 3 * 2**20 for s in executed), [s.step_peak for s in stats]
    assert sum(s.bytes_from_host for s in executed) > 0
    assert "RecordFunction callback" not in capfd.readouterr().err
    holder.clear()
    gc.collect()
    assert tidal._C.memory_cap() == 0, "the cap goes with its session"


def test_a_wall_below_one_op_stops_with_what_the_op_needs(store_dir):
    """A budget below what one op holds at once cannot be met by writing anything out: the
    error is torch's out of memory, naming the op, what it needs and the budget, so that the
    user knows how far to raise it; and the session lifts its wall."""
    data = batches(seed=15, steps=2)
    holder = {}
    make = plan_session(holder, store_dir, budget=2 * 2**20, between_steps="offloaded",
                        wall_by_retry=True)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        train(data, make)
    why = str(raised.value)
    assert "was refused memory under the wall" in why, why
    assert "the op needs its inputs'" in why and "under a budget of 2.00 MiB" in why, why
    assert why.count("(tidal: ") == 1, "one op's reason, not every caller's"
    holder["s"].__exit__(None, None, None)  # as `with session:` does: ends the step, closes
    holder.clear()
    gc.collect()
    assert tidal._C.memory_cap() == 0


def test_the_planner_chooses_the_step_boundary_and_state_dict_reads_true_bytes(store_dir):
    """Default options: at 50% of an MLP whose peak is mostly its state, no plan meets the
    budget with every tensor in memory at each step's end, so the session keeps them on the SSD
    across it ("auto"), says so, and state_dict() (torch.save) brings them back first."""
    data = batches(seed=15, steps=9)
    ref_losses, ref_params, _ = train(data)
    holder = {}

    session = plan_session(holder, store_dir, budget="50%")

    losses, params, stats = train(data, session)
    assert torch.equal(losses, ref_losses)
    last = stats[-1]
    assert last.between_steps == "offloaded", last.between_steps
    assert "between steps" in last.notice and "make_resident" in last.notice
    assert max(s.step_peak for s in stats[3:]) <= last.memory_budget
    assert last.within_budget or last.budget_reason.startswith("no step has run"), \
        last.budget_reason
    # Raw bytes between steps: torch.save of the state dicts, read back, are the true values.
    buf = io.BytesIO()
    try:
        # The restore and the copy read back need the model's state twice: over the wall.
        with tidal.memory_cap(2**40):
            torch.save({"model": holder["model"].state_dict(),
                        "opt": holder["opt"].state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf)
        for p, r in zip(saved["model"].values(), ref_params):
            assert torch.equal(p, r)
        assert len(saved["opt"]["state"]) == len(ref_params)
    finally:
        holder.clear()
        gc.collect()


def test_the_planner_keeps_the_boundary_resident_when_that_meets_the_budget(store_dir):
    data = batches(seed=16, steps=6)
    ref_losses, _, _ = train(data)

    def session(model, opt):  # not strict: the default loop, nothing but the budget
        return tidal.Session(mode="plan", dirs=[store_dir], budget="95%", capacity="1GiB",
                             min_bytes="64KiB", model=model, optimizer=opt)

    losses, _, stats = train(data, session)
    assert torch.equal(losses, ref_losses)
    assert stats[-1].between_steps == "resident"
    assert stats[-1].notice == ""


def test_a_foreach_optimizer_step_runs_in_pieces_that_fit(store_dir, monkeypatch):
    """Adam(foreach=True) updates every parameter in one op, with all the gradients and state:
    at half the state that one op cannot fit. The session splits each group for the step, so
    the same elementwise arithmetic runs in pieces: bit-identical, within the wall."""
    data = batches(seed=17, steps=6)
    state = mlp_state_bytes()
    ref_losses, ref_params, _ = train_mlp(data, seed=11, foreach=True)
    budget = tidal.memory_stats()["current_bytes"] + state // 2
    holder = {}
    losses, params, stats = train_mlp(data, plan_session(holder, store_dir, budget=budget),
                                      seed=11, foreach=True)
    assert torch.equal(losses, ref_losses)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
    assert all(s.step_peak <= budget for s in stats)
    assert len(holder["opt"].param_groups) == 1, "the groups come back after each step"
    holder.clear()
    gc.collect()
    # Without the pieces the one foreach op is over the wall, as it would be on a GPU.
    monkeypatch.setattr(tidal.Session, "_split_multi_tensor_steps", lambda self, opt: None)
    with pytest.raises(torch.OutOfMemoryError):
        train_mlp(data, plan_session(holder, store_dir, budget=budget), seed=11, foreach=True)
    holder.clear()
    gc.collect()
    assert tidal._C.memory_cap() == 0


def test_memory_that_is_not_the_allocators_is_never_moved(store_dir):
    # torch's legacy record_function handle is a 344-byte uint8 tensor whose storage holds a C++
    # object, checked by its deleter when the handle is used; a tensor of numpy's memory aliases
    # the array. Neither may be moved out and given new bytes. With min_bytes=0 and a budget a
    # quarter of the step's, every other storage is moved at some point.
    data = batches(seed=14, steps=8)
    ref_losses, _, _ = train(data)
    model = make_mlp(seed=11)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    s = tidal.Session(mode="plan", dirs=[store_dir], capacity="1GiB", min_bytes=0, model=model,
                      optimizer=opt, strict=True, budget="25%")
    array = np.arange(4096, dtype=np.float32)
    shared = torch.from_numpy(array)
    losses = []
    for x, y in data:
        with s.step():
            handle = torch.ops.profiler._record_function_enter("a user's region", None)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y) + 0 * shared.sum()
            loss.backward()
            opt.step()
            torch.ops.profiler._record_function_exit(handle)  # raised once the handle moved
            shared.add_(1)
        losses.append(loss.detach().clone())
    moved = s.stats().bytes_written
    del s
    gc.collect()
    assert torch.equal(torch.stack(losses), ref_losses)
    assert moved > 0, "nothing was moved: the test would prove nothing"
    assert array[0] == len(data), "torch.from_numpy's tensor no longer aliases the array"
