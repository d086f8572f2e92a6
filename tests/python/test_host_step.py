"""The optimizer step on the host (issue 49), executed on the CPU under the strict meter: the
optimizer's parameters, gradients and state live in host memory, outside the budget; losses and
parameters are bit-identical to the same loop with its optimizer run on the CPU without tidal.
"""

import gc

import pytest
import torch

import tidal

WIDTH, DEPTH, BATCH, SEQ = 512, 3, 8, 32


class Block(torch.nn.Module):
    """A pre-norm transformer block, written the ordinary PyTorch way."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, 4, batch_first=True)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, WIDTH), *[Block(WIDTH) for _ in range(DEPTH)],
                               torch.nn.Linear(WIDTH, 16))


def make_data(seed: int, steps: int, micro: int):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(BATCH, SEQ, 16, generator=g), torch.randn(BATCH, SEQ, 16, generator=g))
             for _ in range(micro)] for _ in range(steps)]


def train(data, *, bf16: bool, session_options=None, clip: bool = False, model_zero: bool = False):
    """The loop a user writes: micro-batches, backward on each, (clipping,) step, zero_grad.
    With session_options, under a tidal.Session (model and optimizer given)."""
    model = make_model(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    session = None
    if session_options is not None:
        session = tidal.Session(model=model, optimizer=opt, **session_options)
    losses = []
    for micro_batches in data:
        if session is not None:
            session.begin_step()
        for x, y in micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            (loss / len(micro_batches)).backward()
            losses.append(loss.detach().float())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        if model_zero:
            model.zero_grad()
        else:
            opt.zero_grad()
        if session is not None:
            session.end_step()
    stats = session.stats() if session is not None else None
    host = session.host_step if session is not None else None
    report = (host.host_bytes(), host.parameters_per_second()) if host is not None else None
    params = [p.detach().clone() for p in model.parameters()]
    if session is not None:
        session.close()
    state = opt.state_dict()["state"]
    return torch.stack(losses), params, stats, report, state


def state_bytes() -> int:
    model = make_model(seed=5)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
def test_host_step_plan_mode_is_bit_identical_within_a_budget_the_device_step_cannot_meet(
        store_dir, bf16):
    data = make_data(seed=7, steps=6, micro=2)
    ref_losses, ref_params, _, _, ref_state = train(data, bf16=bf16)
    params = state_bytes()
    # The budget counts the whole process's tensors (the reference's results too). Parameters,
    # a gradient on its way out and the activations on the device; the gradients and Adam's
    # state on the host. The device step's state alone (4 copies) is over this.
    held = tidal.memory_stats()["current_bytes"]
    budget = held + 2 * params + 32 * 2**20
    assert 4 * params > budget - held
    refusals = tidal.memory_stats()["refusals"]
    losses, got, stats, report, state = train(data, bf16=bf16, session_options=dict(
        mode="plan", dirs=[store_dir], capacity="1GiB", min_bytes="64KiB", budget=budget,
        strict=True, optimizer_step="host"))
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    for p, r in zip(got, ref_params):
        assert torch.equal(p, r)
    for key in ref_state:  # the optimizer's state (on the host, as close() leaves it)
        for name, value in ref_state[key].items():
            assert torch.equal(state[key][name], value), name
    assert tidal.memory_stats()["refusals"] == refusals, "no allocation was refused"
    assert stats.steps_over_budget == 0 and stats.within_budget
    assert stats.step_peak <= budget
    host_bytes, rate = report
    assert host_bytes >= 3 * params  # copies and both moments (zero_grad freed the gradients)
    assert rate is not None and rate > 0
    gc.collect()
    assert tidal._C.memory_cap() == 0


def test_host_step_keeps_clipping_and_model_zero_grad_exact():
    """Code between backward and step sees the gradients (clipping changes them), and
    model.zero_grad() clears them, as without the host step."""
    data = make_data(seed=8, steps=4, micro=3)
    ref = train(data, bf16=False, clip=True, model_zero=True)
    got = train(data, bf16=False, clip=True, model_zero=True,
                session_options=dict(mode="none", optimizer_step="host"))
    assert torch.equal(got[0], ref[0])
    for p, r in zip(got[1], ref[1]):
        assert torch.equal(p, r)


def test_host_memory_is_outside_the_meter_and_the_trace():
    before = tidal.memory_stats()
    with tidal._C.host_memory():
        t = torch.empty(2**20)  # 4 MiB
    after = tidal.memory_stats()
    assert after["current_bytes"] == before["current_bytes"]
    assert after["host_bytes"] == before["host_bytes"] + 4 * 2**20
    assert tidal._C.is_host_memory(t) and not tidal._C.is_host_memory(torch.empty(4))
    with tidal.memory_cap(before["current_bytes"] + 2**20):
        with tidal._C.host_memory():
            big = torch.zeros(2**22)  # 16 MiB over a 1 MiB cap: host memory is not under it
        assert big.sum().item() == 0
    del t, big
    assert tidal.memory_stats()["host_bytes"] == before["host_bytes"]


def test_host_step_refuses_what_it_cannot_do():
    model = make_model(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tidal.InvalidArgument, match="optimizer_step"):
        tidal.Session(mode="none", model=model, optimizer=opt, optimizer_step="cpu")
    with pytest.raises(tidal.InvalidArgument, match="needs the optimizer"):
        tidal.Session(mode="none", model=model, optimizer_step="host")
    host = tidal.optimizer_on_host(opt)
    with pytest.raises(tidal.InvalidArgument, match="already"):
        tidal.optimizer_on_host(opt)
    with pytest.raises(tidal.InvalidArgument, match="closure"):
        opt.step(lambda: 0.0)
    host.remove()
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))
    assert "step" not in opt.__dict__


def test_dropping_model_and_optimizer_frees_device_and_host_memory_at_once():
    """No reference cycle between the step, the optimizer and the parameters' hooks: memory
    comes back when the user drops them, not at the next garbage collection."""
    gc.collect()
    before = tidal.memory_stats()
    gc.disable()
    try:
        model = make_model(seed=2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tidal.optimizer_on_host(opt)
        x, y = make_data(seed=3, steps=1, micro=1)[0][0]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        assert tidal.memory_stats()["host_bytes"] > before["host_bytes"]
        del model, opt, x, y
        after = tidal.memory_stats()
        assert after["current_bytes"] == before["current_bytes"]
        assert after["host_bytes"] == before["host_bytes"]
    finally:
        gc.enable()
