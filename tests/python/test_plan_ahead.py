"""Plans before step 0: traces of a step on fake tensors (tidal.fake_trace) against the traces
profiling records, and Session(plan_ahead=step) running its first steps under the plan."""

import json

import pytest
import torch

import tidal
from tidal import fake_trace

transformers = pytest.importorskip("transformers")
T = transformers


def _llama():
    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))


def _gpt2():
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=1000, n_embd=128, n_layer=2, n_head=4,
                                          n_positions=64))


def _mixtral():
    # batched_mm: every expert's weights are gathered per token, so the ops do not depend on
    # which experts the router picks (the eager loop over the experts hit does).
    return T.MixtralForCausalLM(T.MixtralConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, experts_implementation="batched_mm"))


MODELS = {"gpt2": _gpt2, "llama": _llama, "mixtral": _mixtral}


def _batch(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (2, 32), generator=g)


def _step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _options(tmp_path, budget):
    return dict(mode="plan", dirs=[str(tmp_path)], budget=budget, warmup_steps=0,
                profile_steps=3, retime_steps=0, strict=False, host_memory=0, timeline_steps=0,
                capacity="64MiB", checksum=False)


def _state_bytes(model) -> int:
    return sum(p.numel() * p.element_size() * 3 for p in model.parameters())  # + Adam's two


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fake_trace_is_the_profiled_trace(tmp_path, name):
    """Steps 0 and 1 traced on fake tensors: the same ops, op for op, the same tensors by id
    with the same producers, frees and classes, and bytes within 1% (here: equal)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _batch(1)
    budget = 1 << 34
    fake = fake_trace.trace_step(model, opt, lambda m, o: _step(m, o, ids),
                                 _options(tmp_path, budget))[:2]
    s = tidal.Session(model=model, optimizer=opt, **_options(tmp_path, budget))
    for _ in range(2):
        with s.step():
            _step(model, opt, ids)
    real = [json.loads(t) for t in s._live().recorded_iterations_json()]
    s.close()
    assert len(real) == 2
    for step, (r, f) in enumerate(zip(real, fake)):
        assert [o["name"] for o in f["ops"]] == [o["name"] for o in r["ops"]], step
        wrong = [(x["index"], x["name"]) for x, y in zip(r["ops"], f["ops"])
                 if (x["inputs"], x["outputs"]) != (y["inputs"], y["outputs"])]
        assert not wrong, (step, wrong[:5])
        assert len(f["tensors"]) == len(r["tensors"])
        keys = ("name", "bytes", "producer", "freed_after", "persistent", "class")
        differ = [x["id"] for x, y in zip(r["tensors"], f["tensors"])
                  if any(x[k] != y[k] for k in keys)]
        assert not differ, (step, differ[:5])
        real_bytes = sum(x["bytes"] for x in r["tensors"])
        fake_bytes = sum(x["bytes"] for x in f["tensors"])
        assert abs(fake_bytes - real_bytes) <= 0.01 * real_bytes
        assert all(x["device"] == "cpu" for x in f["tensors"])


def _train(model, opt, steps, session=None):
    losses = []
    for k in range(steps):
        ids = _batch(10 + k)
        if session is None:
            losses.append(_step(model, opt, ids).item())
            continue
        with session.step():
            loss = _step(model, opt, ids)
        losses.append(loss.item())
    return losses


def _ahead_session(tmp_path):
    """A Llama as _reference makes it, its AdamW, and a session at half its state under the
    strict meter that plans ahead from a step on batch 10."""
    torch.manual_seed(0)
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = _batch(10)
    s = tidal.Session(mode="plan", dirs=[str(tmp_path)], budget=_state_bytes(model) // 2,
                      strict=True, model=model, optimizer=opt,
                      plan_ahead=lambda m, o: _step(m, o, ids))
    return model, opt, s


def _reference(steps):
    torch.manual_seed(0)
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _train(model, opt, steps)


def test_plan_ahead_runs_step_zero_under_the_plan(tmp_path):
    """A model whose state is twice the budget: with plan_ahead, step 0 already follows a plan
    (step 0's own, then step 1's from step 1 on; no profiled steps, no misses to speak of)
    under the strict wall, and the losses are bit-identical to training without offloading."""
    steps = 4
    want = _reference(steps)
    model, opt, s = _ahead_session(tmp_path)
    st = s.stats()
    assert st.planned_ahead and st.state == "executing" and st.shapes == 1
    shapes, losses = [], []
    for k in range(steps):
        ids = _batch(10 + k)  # outside the step, as in the step given to plan_ahead
        with s.step():
            loss = _step(model, opt, ids)
        losses.append(loss.item())
        st = s.stats()
        shapes.append(st.shape)
        assert st.misses <= 4, (k, st)
    s.close()
    assert losses == want
    assert shapes == [0] * steps, shapes
    assert st.bytes_written > 0  # the plan moved tensors: the state does not fit
    assert "left the plan" not in st.notice


def test_a_loop_that_leaves_the_plan_made_ahead_trains_under_the_wall(tmp_path):
    """The loop makes its batch inside the step (an op the step given to plan_ahead does not
    run): every step leaves the plan at op 0, is said once, runs on demand under the strict
    wall (evicting the storages read least recently), and is planned from its profile; the
    losses stay bit-identical."""
    steps = 4
    want = _reference(steps)
    model, opt, s = _ahead_session(tmp_path)
    losses = []
    for k in range(steps):
        with s.step():
            loss = _step(model, opt, _batch(10 + k))
        losses.append(loss.item())
    st = s.stats()
    s.close()
    assert losses == want
    assert "left the plan made ahead (op 0 is aten::randint" in st.notice
    assert st.shape >= 0  # the loop's own shape, profiled, runs a plan by the last step


def test_a_step_fake_tensors_cannot_run_falls_back_to_profiling(tmp_path, capfd):
    """Data-dependent shapes (nonzero) cannot run on fake tensors: the session says so, profiles
    its first steps instead, and trains as without plan_ahead."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64)

    def step(m, o):
        h = m(x)
        loss = h[h.nonzero()[:, 0]].sum()
        loss.backward()
        o.step()
        o.zero_grad()

    with tidal.Session(mode="plan", dirs=[str(tmp_path)], budget=1 << 30, model=model,
                       optimizer=opt, plan_ahead=step) as s:
        assert not s.stats().planned_ahead
        assert "nonzero" in capfd.readouterr().err
        for _ in range(4):
            with s.step():
                step(model, opt)
        assert s.stats().state == "executing"


def test_plan_ahead_is_refused_where_it_cannot_apply(tmp_path):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tidal.InvalidArgument, match="plan mode"):
        tidal.Session(mode="activations", dirs=[str(tmp_path)], model=model, optimizer=opt,
                      plan_ahead=lambda m, o: None)
    with pytest.raises(tidal.InvalidArgument, match="needs the model"):
        tidal.Session(mode="plan", dirs=[str(tmp_path)], budget=1 << 30,
                      plan_ahead=lambda m, o: None)
