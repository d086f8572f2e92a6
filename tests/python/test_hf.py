"""Hugging Face models as users have them: Llama, GPT-2 and a mixture of experts (Qwen2-MoE)
built from configs with random weights (no downloads), trained on text this repository ships
(docs/runtime.md, as bytes), in every mode, and the transformers Trainer with TidalCallback.
Losses are those of the same loop without tidal, bit for bit."""

import os

import pytest
import torch

import tidal

transformers = pytest.importorskip("transformers")
from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig,  # noqa: E402
                          LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM)

TEXT = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "runtime.md")
SEQ = 64
BATCH = 4
HIDDEN = 64  # bench/hf_models.py sets larger ones
LAYERS = 2


def text_ids() -> torch.Tensor:
    with open(TEXT, "rb") as f:
        return torch.tensor(list(f.read()), dtype=torch.long)  # bytes: a vocabulary of 256


def make(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    h, n = HIDDEN, LAYERS
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(
            vocab_size=256, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=n,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=h, n_layer=n, n_head=4,
                                          n_positions=SEQ, bos_token_id=0, eos_token_id=0))
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=256, hidden_size=h, intermediate_size=2 * h, moe_intermediate_size=h // 2,
        shared_expert_intermediate_size=h, num_hidden_layers=n, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=SEQ))


def batches(steps: int, seed: int = 1):
    ids = text_ids()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - SEQ - 1, (BATCH,), generator=g)
        out.append(torch.stack([ids[i:i + SEQ] for i in starts]))
    return out


def train(family, data, session_options=None, accumulate=1):
    """An ordinary loop (AdamW, the model's own loss); session_options=None: without tidal."""
    model = make(family)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = (tidal.Session(model=model, optimizer=opt, **session_options)
               if session_options is not None else None)
    losses, stats = [], []
    for x in data:
        if session is not None:
            session.begin_step()
        for micro in x.chunk(accumulate):
            loss = model(input_ids=micro, labels=micro).loss / accumulate
            loss.backward()
            losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
        if session is not None:
            session.end_step()
            stats.append(session.stats())
    if session is not None:
        session.close()
    return torch.stack(losses), stats, model


def options(store_dir, mode, **extra):
    base = {"mode": mode, "dirs": [store_dir], "capacity": "512MiB", "min_bytes": "16KiB"}
    if mode == "activations":
        base["adaptive"] = False  # every step after the reference step writes
    if mode == "plan":
        base["budget"] = "50%"
        base["strict"] = True  # the budget is a wall, as on a GPU: no step can go over it
    base.update(extra)
    return base


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2_moe"])
def test_each_family_trains_bit_identical_in_every_mode(family, store_dir):
    data = batches(10)
    ref, _, _ = train(family, data)
    for mode in ("activations", "plan"):
        losses, stats, _ = train(family, data, options(store_dir, mode))
        assert torch.equal(losses, ref), (mode, (losses - ref).abs().max())
        assert sum(s.bytes_written for s in stats) > 0, f"{mode} moved nothing"
        if mode == "plan":
            last = stats[-1]
            assert last.state == "executing"
            if family == "llama":  # the target: a 50% budget met on a Llama model
                # Every step that ran a plan peaked within it (the meter's figure)...
                assert max(s.step_peak for s in stats[3:]) <= last.memory_budget
                assert all(s.steps_over_budget == 0 for s in stats[2:]), last.budget_reason
                # ...and the session says so, unless the last step had its plan made again for
                # less (a step kept within the budget only by evictions is planned again; the
                # count of steps measured then starts afresh, and a plan for less than the ops
                # need is explained in budget_reason, as in test_session.py).
                if last.tightenings == stats[-2].tightenings:
                    assert last.within_budget, last.budget_reason


def sparse_moe() -> torch.nn.Module:
    # 16 experts, one per token, 16 tokens a step: each step computes only the experts its
    # tokens were routed to (transformers loops over the experts hit), so its op sequence
    # changes with the routing.
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=16, num_experts_per_tok=1,
        max_position_embeddings=SEQ))


def test_mixture_of_experts_with_changing_routing_stays_within_budget(store_dir):
    ids = text_ids()
    g = torch.Generator().manual_seed(3)
    data = [ids[i:i + 16].unsqueeze(0) for i in torch.randint(0, len(ids) - 17, (24,),
                                                               generator=g)]

    def run(session_options):
        model = sparse_moe()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        routed = []  # the set of experts the first layer's tokens went to, per step
        model.model.layers[0].mlp.gate.register_forward_hook(
            lambda _m, _i, out: routed.append(frozenset(out[2].flatten().tolist())))
        session = (tidal.Session(model=model, optimizer=opt, **session_options)
                   if session_options else None)
        losses, stats = [], []
        for x in data:
            if session:
                session.begin_step()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
            if session:
                session.end_step()
                stats.append(session.stats())
        if session:
            session.close()
        return torch.stack(losses), stats, routed

    ref, _, routed = run(None)
    assert len(set(routed)) > 10, "the routing hardly changed: the test would prove little"
    losses, stats, _ = run(options(store_dir, "plan", min_bytes=0))
    assert torch.equal(losses, ref)
    # stats[i] is the state after step i: the step that made the plan reports "executing".
    planned_at = next(i for i, s in enumerate(stats) if s.state == "executing")
    executed = stats[planned_at + 1:]
    assert len(executed) >= 20
    # Profiled once: a step whose ops leave the planned sequence goes on on demand under the
    # wall, and a sequence is planned only when it is seen a second time (docs/runtime.md).
    assert all(s.state == "executing" for s in executed)
    assert stats[-1].within_budget, stats[-1].budget_reason
    assert all(s.step_peak <= s.memory_budget for s in executed)
    print(f"routing sets: {len(set(routed))} of {len(routed)} steps; shapes planned: "
          f"{stats[-1].shapes}, re-plans: {stats[-1].replans}")


def test_gradient_accumulation_checkpointing_eval_and_save_between_steps(store_dir, tmp_path):
    data = batches(8, seed=5)
    ref, _, _ = train("llama", data, accumulate=2)
    model = make("llama")
    (model.activation_checkpointing_enable if hasattr(model, "activation_checkpointing_enable")
     else model.gradient_checkpointing_enable)()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    with tidal.Session(model=model, optimizer=opt, **options(store_dir, "plan")) as session:
        for i, x in enumerate(data):
            with session.step():
                for micro in x.chunk(2):
                    loss = model(input_ids=micro, labels=micro).loss / 2
                    loss.backward()
                    losses.append(loss.detach().clone())
                opt.step()
                opt.zero_grad()
            if i % 3 == 2:  # evaluation and a checkpoint between steps
                model.eval()
                with torch.no_grad():
                    model(input_ids=data[0], labels=data[0])
                model.train()
                model.save_pretrained(tmp_path / f"step{i}")
    assert torch.equal(torch.stack(losses), ref)
    saved = type(model).from_pretrained(tmp_path / "step5")
    # The checkpoint after step 6 holds what training without tidal had then.
    _, _, ref6_model = train("llama", data[:6], accumulate=2)
    for (n, p), (_, q) in zip(saved.named_parameters(), ref6_model.named_parameters()):
        assert torch.equal(p, q), n


def test_trainer_callback_same_losses_lower_peak(store_dir, tmp_path):
    from transformers import Trainer, TrainingArguments

    from tidal.hf import TidalCallback

    ids = text_ids()
    g = torch.Generator().manual_seed(7)
    starts = torch.randint(0, len(ids) - SEQ - 1, (192,), generator=g)
    dataset = [{"input_ids": ids[i:i + SEQ], "labels": ids[i:i + SEQ]} for i in starts]

    def run(callbacks):
        model = make("llama")
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=12,
                                 per_device_train_batch_size=16, logging_steps=1, report_to=[],
                                 use_cpu=True, seed=0, data_seed=0, save_strategy="no",
                                 dataloader_num_workers=0, learning_rate=1e-3)
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    plain = run([])
    # mode "none" measures the step's peak without moving anything: the baseline.
    baseline = TidalCallback(mode="none")
    assert run([baseline]) == plain
    callback = TidalCallback(mode="activations", dirs=[store_dir], capacity="512MiB",
                             min_bytes="16KiB", adaptive=False)
    with_tidal = run([callback])
    assert with_tidal == plain
    assert len(plain) == 12
    assert callback.session is None, "the session is closed when training ends"
    assert callback.last_stats.bytes_written > 0
    # Plan mode through the Trainer (Accelerate's optimizer wrapper unwrapped): same losses and
    # a lower peak, held by the executor before every op. (Activation mode's peak depends on
    # the writes finishing before backward: on a loaded 2-core machine they may not.)
    planned = TidalCallback(mode="plan", dirs=[store_dir], capacity="512MiB",
                            min_bytes="16KiB", budget="50%", strict=True)
    assert run([planned]) == plain
    assert planned.last_stats.state == "executing" and planned.last_stats.within_budget
    assert planned.last_stats.step_peak < baseline.last_stats.step_peak, (
        planned.last_stats.step_peak, baseline.last_stats.step_peak)
    # The optimizer step on the host through the Trainer (its clipping and model.zero_grad()
    # included): the same losses, the step's state outside the budget.
    host = TidalCallback(mode="plan", dirs=[store_dir], capacity="512MiB", min_bytes="16KiB",
                         budget="50%", strict=True, optimizer_step="host")
    assert run([host]) == plain
    assert host.last_stats.within_budget and host.last_stats.steps_over_budget == 0
    print(f"Trainer step peak: {planned.last_stats.step_peak} B in plan mode, "
          f"{callback.last_stats.step_peak} B in activation mode, "
          f"{baseline.last_stats.step_peak} B without")
