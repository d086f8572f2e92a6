"""The optimizer step in pieces (tidal/_optimizer_split.py) on its own, without a session: a
foreach group larger than a piece steps as several groups with the arithmetic of the whole group,
bit for bit, and is whole again after the step; group state that the pieces disagree on is
refused."""

import pytest
import torch

import tidal
from tidal._optimizer_split import OptimizerSplit, join_groups


def params_of_odd_sizes(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (40000, 1025, 513, 70001, 3)]


def train(make_opt, split_bytes=None, steps: int = 4):
    """`steps` optimizer steps on fixed random gradients; with split_bytes, under an
    OptimizerSplit of that byte budget (hooked as a session hooks it). Returns the final
    parameters, the optimizer, and how many groups each step saw."""
    params = params_of_odd_sizes(seed=5)
    opt = make_opt(params)
    seen = []
    if split_bytes is not None:
        split = OptimizerSplit(split_bytes)
        opt.register_step_pre_hook(lambda o, _a, _k: split.split(o, lambda: 0))
        opt.register_step_post_hook(lambda o, _a, _k: join_groups(o, checked=True))
    opt.register_step_pre_hook(lambda o, _a, _k: seen.append(len(o.param_groups)))
    g = torch.Generator().manual_seed(6)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params], opt, seen


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
], ids=["adam", "sgd-momentum"])
def test_a_group_stepped_in_pieces_is_bit_identical_and_whole_again(make_opt):
    want, _, whole = train(make_opt)
    # A budget of 8 MiB: pieces of 1 MiB. The group counts 16 bytes an element (a parameter,
    # its gradient and two moments), 1.8 MB: it steps as three pieces.
    got, opt, seen = train(make_opt, split_bytes=8 << 20)
    assert whole == [1] * 4
    assert seen == [3] * 4
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert len(opt.param_groups) == 1
    assert len(opt.param_groups[0]["params"]) == 5
    assert opt._tidal_split is None


def test_a_group_that_fits_a_piece_is_not_split():
    _, opt, seen = train(lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
                         split_bytes=1 << 30)
    assert seen == [1] * 4
    assert getattr(opt, "_tidal_split", None) is None


def test_the_piece_size_is_fixed_at_the_first_step():
    opt = torch.optim.Adam(params_of_odd_sizes(seed=1), lr=1e-2, foreach=True)
    split = OptimizerSplit(0)  # a budget given as a share: not known in bytes
    # Nothing measured yet: an eighth of the group's state, at least 1 MiB.
    first = split.piece_bytes(opt, lambda: 0)
    assert first == 1 << 20
    assert split.piece_bytes(opt, lambda: 64 << 20) == first
    measured = OptimizerSplit(0)
    assert measured.piece_bytes(opt, lambda: 64 << 20) == 8 << 20
    assert OptimizerSplit(32 << 20).piece_bytes(opt, lambda: 0) == 4 << 20


def test_group_state_the_pieces_disagree_on_is_refused():
    class GroupNormSGD(torch.optim.SGD):
        def step(self, closure=None):
            for g in self.param_groups:
                g["norm"] = float(sum(p.detach().norm() for p in g["params"]))
            return super().step(closure)

    with pytest.raises(tidal.Error, match="foreach=False"):
        train(lambda ps: GroupNormSGD(ps, lr=1e-2, foreach=True), split_bytes=8 << 20, steps=1)
