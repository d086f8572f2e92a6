"""tidal from Python with CUDA tensors: tidal.Session in modes none, activations and plan, and
tidal.offload_activations, give the losses of training without tidal bit for bit and move the
tensors' bytes through the store; the session's memory meter is compared with the CUDA caching
allocator's peak.

Every test here skips, with the reason, on a machine where torch sees no CUDA device (bench/gpu.sh
runs them on a GPU machine)."""

import contextlib
import os
import re

# Deterministic cuBLAS for the bit-identity checks; read when cuBLAS starts (the first matmul on
# the device), so set before any test of this module uses CUDA. The small setting (8 x 16 KiB a
# cuBLAS handle; bench/gpu.sh exports the large one, 8 x 4 MiB, for gpt2): this module's MLP peaks
# near 40 MB of tensors, and two handles of 32 MiB (the forward thread's and autograd's device
# thread's), outside any trace, would leave the plan test's byte budget no room.
os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"

import pytest  # noqa: E402
import torch  # noqa: E402

import tidal  # noqa: E402
from conftest import batches, loop_step, make_mlp, train_mlp, wait_for_writes  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none on "
           "this machine")

STEPS = 7  # plan mode: 1 warm-up + 2 profiled steps, then 4 executed
DEVICE = "cuda"

# tidal.Session meters the device its model is on (or its `device` argument): here the CUDA
# caching allocator's allocated bytes.


@pytest.fixture(scope="module", autouse=True)
def deterministic():
    """The reference run and the tidal run must take the same kernels: deterministic algorithms
    where torch has them (a warning, not an error, where it has none), no TF32."""
    was = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.use_deterministic_algorithms(was, warn_only=was_warn)
    torch.backends.cuda.matmul.allow_tf32 = tf32


def cuda_batches(seed: int, steps: int):
    return [(x.to(DEVICE), y.to(DEVICE)) for x, y in batches(seed=seed, steps=steps)]


def train(data, session=None):
    """Adam on the MLP on the GPU. Returns the losses, the final weights, the session's stats
    after each step and the CUDA allocator's peak of each step."""
    peaks = []

    def before():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def after():
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())

    losses, params, stats = train_mlp(data, session, seed=3, device=DEVICE, before_step=before,
                                      after_step=after)
    return losses, params, stats, peaks


@pytest.fixture(scope="module")
def reference():
    data = cuda_batches(seed=4, steps=STEPS)
    losses, params, _, peaks = train(data)
    assert losses.is_cuda and all(p.is_cuda for p in params)
    # Kept in host memory: the reference's weights on the GPU would be memory the sessions of
    # the later tests never touch (10 MB beside the MLP's 49 MB peak: the plan test's budget of
    # half that peak would leave the plan too little to step one parameter).
    return data, losses, [p.cpu() for p in params], peaks


def assert_same_training(losses, params, ref_losses, ref_params):
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    for p, r in zip(params, ref_params):
        assert p.is_cuda
        assert torch.equal(p.cpu(), r.cpu()), (p.cpu() - r.cpu()).abs().max()


def test_mode_none_on_cuda_is_bit_identical(reference):
    data, ref_losses, ref_params, _ = reference

    def session(model, opt):
        return tidal.Session(mode="none", model=model, optimizer=opt)

    losses, params, stats, _ = train(data, session)
    assert_same_training(losses, params, ref_losses, ref_params)
    assert all(s.mode == "none" and s.state == "off" for s in stats)
    assert all(s.bytes_written == 0 and s.bytes_read == 0 for s in stats)


def test_activation_mode_on_cuda_is_bit_identical_and_writes(reference, store_dir):
    data, ref_losses, ref_params, _ = reference

    def session(model, opt):
        # adaptive=False: every step after the reference step offloads, whatever the peaks.
        return tidal.Session(mode="activations", dirs=[store_dir], capacity="256MiB",
                             min_bytes="64KiB", model=model, optimizer=opt, adaptive=False)

    losses, params, stats, _ = train(data, session)
    assert_same_training(losses, params, ref_losses, ref_params)
    assert all(s.state == "executing" for s in stats)
    # The warm-up step and the reference step keep everything; the later ones write the saved
    # activations of 128 x 1024 floats (512 KiB, CUDA memory) to the store.
    assert sum(s.bytes_written for s in stats[2:]) > 0, stats[-1]
    assert all(s.write_failures == 0 for s in stats), stats[-1].write_error


def test_plan_mode_on_cuda_is_bit_identical_and_executes(reference, store_dir):
    data, ref_losses, ref_params, ref_peaks = reference
    holder = {}
    # A budget in bytes, half of what the reference steps took from the CUDA allocator: the
    # planner plans the traced CUDA tensors for it, less the memory outside the trace.
    budget = max(ref_peaks) // 2

    def session(model, opt):
        holder["s"] = tidal.Session(mode="plan", dirs=[store_dir], budget=budget,
                                    capacity="512MiB", min_bytes="64KiB", model=model,
                                    optimizer=opt, between_steps="offloaded", name="mlp-cuda")
        return holder["s"]

    losses, params, stats, peaks = train(data, session)
    assert_same_training(losses, params, ref_losses, ref_params)
    assert [s.state for s in stats[:2]] == ["warmup", "profiling"]
    assert all(s.state == "executing" for s in stats[2:]), [s.state for s in stats]
    last = stats[-1]
    assert last.mode == "plan" and last.memory_budget == budget
    # A first plan whose measured step went over the budget (the allocator's rounding) is
    # tightened and replaced: "plan 1:" and on are as good.
    assert last.shapes >= 1 and re.match(r"plan \d+:", last.plan_summary), last.plan_summary
    # The wall: every executed step of the last plan, by the CUDA allocator's own peak.
    why = dict(budget=budget, ref_peaks=ref_peaks, peaks=peaks,
               step_peaks=[s.step_peak for s in stats], untouched=last.untouched_bytes,
               profiled_peak=last.profiled_peak, reason=last.budget_reason,
               tightenings=last.tightenings, executed_peak=last.executed_peak)
    assert last.within_budget, why
    assert max(peaks[-2:]) <= budget, why
    # The executed steps moved bytes through the store, as the plan said.
    assert sum(s.bytes_written for s in stats[3:]) > 0, last
    assert last.planned_bytes_to_ssd > 0
    assert all(s.write_failures == 0 for s in stats), last.write_error
    # The profiled trace saw CUDA tensors, under their Python names.
    tensors = {t["name"]: t for t in holder["s"].trace["tensors"]}
    assert tensors["0.weight"]["device"].startswith("cuda")
    assert "0.weight.exp_avg" in tensors
    holder["s"].make_resident()  # every moved tensor back on the device before teardown


def deep_mlp(seed: int) -> torch.nn.Module:
    """An MLP of 17M parameters (67 MB) in 4 MiB weights: its state is far above the CUDA caching
    allocator's granularity (2 MiB pages, 20 MiB segments; the conftest MLP's 10 MB would give a
    wall smaller than one segment), while the optimizer step of one weight (the weight, its
    gradient, Adam's two moments and a temporary) fits well within half of it."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(16):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))


def train_deep(data, make_session=None):
    """deep_mlp(3) trained with Adam on `data`, an ordinary loop, inside `with session:` (which
    ends a step an exception left open and closes the session, lifting its wall). Returns the
    losses, the final weights (on the CPU), the session's stats after each step and the CUDA
    allocator's peak of each step."""
    model = deep_mlp(seed=3).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, stats, peaks = [], [], []
    session = make_session(model, opt) if make_session else None
    with session if session else contextlib.nullcontext():
        for x, y in data:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            loss = loop_step(model, opt, x, y, session)
            if session:
                stats.append(session.stats())
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            losses.append(loss.detach().cpu())
        if session:
            session.make_resident()
        params = [p.detach().cpu() for p in model.parameters()]
    return torch.stack(losses), params, stats, peaks


def test_a_model_twice_the_budget_trains_within_it_from_step_0_on_cuda(store_dir):
    """strict=True with a budget in bytes on CUDA: the caching allocator's memory fraction is the
    wall from step 0, and an op refused memory runs again once the executor has written tensors
    out. The model's state (weights, gradients, Adam's moments) is about twice what the budget
    leaves it: every step, warm-up and profiling included, stays within the budget by the
    allocator's own peak, with the losses of training without tidal, bit for bit."""
    g = torch.Generator().manual_seed(8)
    data = [(torch.randn(128, 1024, generator=g).to(DEVICE),
             torch.randint(0, 10, (128,), generator=g).to(DEVICE)) for _ in range(STEPS)]
    ref_losses, ref_params, _, _ = train_deep(data)
    state = 4 * sum(p.numel() * p.element_size() for p in ref_params)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # What is allocated now (the data), the model's weights (moved in before the session), and
    # half of the rest of its state.
    budget = torch.cuda.memory_allocated() + state // 4 + state // 4

    def session(model, opt):
        return tidal.Session(mode="plan", dirs=[store_dir], budget=budget, strict=True,
                             capacity="2GiB", min_bytes="64KiB", model=model, optimizer=opt,
                             between_steps="offloaded", name="mlp-wall")

    losses, params, stats, peaks = train_deep(data, session)
    why = dict(budget=budget, state=state, peaks=peaks, step_peaks=[s.step_peak for s in stats],
               notice=stats[-1].notice, reason=stats[-1].budget_reason,
               retries=stats[-1].out_of_memory_retries)
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r), (p - r).abs().max()
    assert [s.state for s in stats[:3]] == ["warmup", "profiling", "executing"], why
    assert max(peaks) <= budget, why
    assert stats[0].bytes_written > 0, why  # the warm-up step already moved state out
    # The wall went with the session: the allocator may use the whole device again.
    big = torch.empty(4 * budget, dtype=torch.uint8, device=DEVICE)
    del big


def test_offload_activations_on_cuda_is_bit_identical_and_uses_the_store(store_dir):
    data = cuda_batches(seed=2, steps=4)

    def run(offload=None):
        losses, params, _ = train_mlp(data, seed=1, device=DEVICE, offload=offload)
        return losses, params

    ref_losses, ref_params = run()
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes="64KiB", capacity="256MiB",
                                        adaptive=False)
    losses, params = run(offload)
    offload.end_step()
    last = offload.stats()
    store = offload.store_stats()
    offload.close()
    assert_same_training(losses, params, ref_losses, ref_params)
    assert last.offloaded > 0 and last.packed > 0
    assert last.kept_parameter > 0  # weights never go to the store
    assert store["bytes_written"] > 0
    assert store["bytes_read"] > 0
    assert store["failed_requests"] == 0, store


def test_offloaded_cuda_tensor_comes_back_exactly(store_dir):
    """One saved CUDA tensor through the store and back: the gradient is exact, the bytes went
    through the store (cuFile or the staging buffers: the backend says which)."""
    offload = tidal.offload_activations(dirs=[store_dir], min_bytes=0, capacity="64MiB",
                                        adaptive=False)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    a = torch.randn(512, 512, device=DEVICE, generator=g, requires_grad=True)
    with offload:
        # exp saves its result (1 MiB of device memory), held by autograd alone: once written,
        # backward reads it back from the store.
        total = a.exp().sum()
    wait_for_writes(offload, 1)
    total.backward()
    offload.end_step()
    store = offload.store_stats()
    offload.close()
    assert offload.stats().offloaded >= 1
    assert store["bytes_written"] >= 512 * 512 * 4
    assert store["bytes_read"] >= 512 * 512 * 4
    assert a.grad.is_cuda
    assert torch.equal(a.grad, a.detach().exp())
    # Device memory reaches the files through cuFile ("+cufile" in the backend's name) or
    # through pinned staging buffers (counted in staged_ops).
    assert "cufile" in store["backend"] or store["staged_ops"] > 0, store


def test_memory_meter_agrees_with_the_cuda_allocator():
    data = cuda_batches(seed=6, steps=3)
    model = make_mlp(seed=3).to(DEVICE)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = tidal.Session(mode="none", model=model, optimizer=opt)  # the model's device
    rows = []
    for x, y in data:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with session.step():  # resets the meter's peak (on CUDA: the allocator's) at its start
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        rows.append((session.stats().step_peak, torch.cuda.max_memory_allocated()))
    # Within reason: the same counter read a moment apart; 5% or 1 MiB for what the step's
    # end may allocate.
    off = [(meter, cuda) for meter, cuda in rows if abs(meter - cuda) > max(cuda // 20, 1 << 20)]
    assert not off, f"(session meter, torch.cuda.max_memory_allocated) per step: {rows}"
    assert all(cuda > 0 for _, cuda in rows)


def test_host_step_on_cuda_matches_the_same_optimizer_on_the_host(store_dir):
    """The optimizer step on the host beside a GPU: the gradients cross to pinned memory on a
    side stream and the step is Adam on CPU tensors, so the reference is the same host step
    without offloading (tidal.optimizer_on_host, no session); plan mode under the wall with
    optimizer_step="host" gives its losses and parameters bit for bit, and the device peak holds
    no optimizer state."""
    data = batches(seed=31, steps=STEPS)

    def host_only(model, opt):
        tidal.optimizer_on_host(opt)
        return None

    ref_losses, ref_params, _ = train_mlp(data, session=host_only, device=DEVICE)
    holder = {}

    def make(model, opt):
        holder["s"] = tidal.Session(mode="plan", dirs=[store_dir], capacity="1GiB",
                                    min_bytes="64KiB", model=model, optimizer=opt,
                                    optimizer_step="host", budget="50%")
        return holder["s"]

    losses, params, stats = train_mlp(data, session=make, device=DEVICE)
    assert torch.equal(losses.cpu(), ref_losses.cpu())
    for p, r in zip(params, ref_params):
        assert torch.equal(p.cpu(), r.cpu())
    assert stats[-1].state == "executing" and stats[-1].steps_over_budget == 0
    assert holder["s"].host_step.host_bytes() > 0
    holder["s"].close()
