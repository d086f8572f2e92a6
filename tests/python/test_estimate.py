"""tidal.estimate before a run: Hugging Face decoders built on the meta device (nothing
allocated), their configs, and clear errors for what it does not model."""

import json
import random

import pytest
import torch

import tidal

transformers = pytest.importorskip("transformers")


def random_llama(rng: random.Random):
    heads = rng.choice([4, 8])
    return transformers.LlamaConfig(
        vocab_size=rng.randrange(500, 4000), hidden_size=heads * rng.choice([16, 32]),
        intermediate_size=rng.randrange(64, 512), num_hidden_layers=rng.randrange(1, 5),
        num_attention_heads=heads, num_key_value_heads=heads // rng.choice([1, 2, 4]))


def random_mixtral(rng: random.Random):
    return transformers.MixtralConfig(
        vocab_size=rng.randrange(500, 4000), hidden_size=128,
        intermediate_size=rng.randrange(64, 384),
        num_hidden_layers=rng.randrange(1, 4), num_attention_heads=8, num_key_value_heads=2,
        num_local_experts=rng.choice([4, 8]), num_experts_per_tok=2)


def random_gpt2(rng: random.Random):
    return transformers.GPT2Config(vocab_size=rng.randrange(500, 4000), n_embd=128,
                                   n_layer=rng.randrange(1, 4), n_head=4)


MODELS = {"llama": (random_llama, transformers.LlamaForCausalLM),
          "mixtral": (random_mixtral, transformers.MixtralForCausalLM),
          "gpt2": (random_gpt2, transformers.GPT2LMHeadModel)}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_model_on_the_meta_device_is_estimated_without_memory(kind):
    make_config, cls = MODELS[kind]
    rng = random.Random(kind)
    for _ in range(2):
        config = make_config(rng)
        with torch.device("meta"):
            model = cls(config)
        before = tidal.memory_stats()["current_bytes"]
        e = tidal.estimate(model, batch=2, seq=64, budget="8GiB", host_memory="4GiB",
                           ssd="1x2/2GB/s", optimizer=torch.optim.AdamW)
        assert tidal.memory_stats()["current_bytes"] == before
        # The analytic trace has the model's parameters, counted independently by PyTorch.
        assert e.parameters == sum(p.numel() for p in model.parameters()), config
        assert e.fits, e.note
        assert 0 < e.planned_peak_bytes <= e.device_memory == 8 << 30
        # The ideal step runs the optimizer on the device; on the host it may run beside the
        # device's work and beat it.
        if e.optimizer_step == "device":
            assert e.ideal_seconds <= e.step_seconds
        assert e.lower_bound_seconds is not None
        assert e.lower_bound_seconds <= e.step_seconds * (1 + 1e-9)  # summed in another order
        assert e.batch == 2 and e.seq == 64
        opts = e.session_options()
        assert opts["budget"] == 8 << 30 and opts["optimizer_step"] in ("device", "host")
        assert "fits" in str(e)


def test_a_config_a_dict_and_a_path_give_the_same_estimate(tmp_path):
    config = random_llama(random.Random(7))
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    kw = dict(batch=1, seq=128, budget=1 << 30, host_memory=0, ssd="2x3/3GB/s")
    a = tidal.estimate(config, **kw)
    b = tidal.estimate(json.loads(config.to_json_string()), **kw)
    c = tidal.estimate(str(path), **kw)
    for x in (b, c):
        assert (x.parameters, x.planned_peak_bytes, x.step_seconds) == \
               (a.parameters, a.planned_peak_bytes, a.step_seconds)


def test_less_memory_never_plans_a_faster_step_and_too_little_does_not_fit():
    config = random_llama(random.Random(3))
    kw = dict(batch=4, seq=256, host_memory=0, ssd="1x1/1GB/s", optimizer_step="device")
    roomy = tidal.estimate(config, budget="16GiB", **kw)
    assert roomy.fits and roomy.ssd_bytes_written == 0
    tight = tidal.estimate(config, budget=roomy.planned_peak_bytes * 3 // 4, **kw)
    assert tight.fits and tight.ssd_bytes_written > 0
    assert tight.step_seconds >= roomy.step_seconds
    none = tidal.estimate(config, budget="1MiB", **kw)
    assert not none.fits and none.note


def test_a_built_in_model_by_name():
    e = tidal.estimate("llama3-8b", batch=1, seq=512, budget="80GiB", host_memory="256GiB")
    assert e.fits and 7.9e9 < e.parameters < 8.1e9


def test_what_it_does_not_model_is_refused_with_what_to_do():
    with pytest.raises(tidal.InvalidArgument, match="tidal.Session"):
        tidal.estimate(torch.nn.Linear(4, 4), batch=1, seq=8, budget="1GiB")
    with pytest.raises(tidal.InvalidArgument, match="not SGD"):
        tidal.estimate("llama3-8b", batch=1, seq=8, budget="1GiB", optimizer=torch.optim.SGD)
    with pytest.raises(tidal.InvalidArgument, match="falcon"):
        tidal.estimate({"model_type": "falcon"}, batch=1, seq=8, budget="1GiB")
    with pytest.raises(tidal.InvalidArgument, match="num_hidden_layers"):
        tidal.estimate({"model_type": "llama", "hidden_size": 64}, batch=1, seq=8, budget="1GiB")
    with pytest.raises(tidal.InvalidArgument, match="a size is bytes"):
        tidal.estimate("llama3-8b", batch=1, seq=8, budget=-1)


def _cnn():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(64, 10))


def _cnn_step(batch):
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))

    def step(model, optimizer):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def test_any_module_from_its_step_on_fake_tensors():
    """A module tidal has no analytic model of (a CNN in the ordinary style), built by a
    function on fake tensors: the estimate counts its parameters as PyTorch does, fits on a
    large device and not on a tiny one, and its step takes longer at a larger batch."""
    want = sum(p.numel() for p in _cnn().parameters())
    small = tidal.estimate(_cnn, budget="1GiB", step=_cnn_step(8))
    large = tidal.estimate(_cnn, budget="1GiB", step=_cnn_step(64))
    assert small.parameters == large.parameters == want
    assert small.fits and large.fits
    assert large.step_seconds > small.step_seconds > 0
    assert large.planned_peak_bytes > small.planned_peak_bytes
    tiny = tidal.estimate(_cnn, budget=64 << 10, step=_cnn_step(64))
    assert not tiny.fits


def test_a_module_and_its_config_estimate_the_same_state():
    """A Hugging Face Llama from its step on fake tensors against the analytic trace of its
    config: the same parameter count; both fit on a large device."""
    rng = random.Random(3)
    config = random_llama(rng)
    ids = torch.randint(0, config.vocab_size, (2, 64))

    def step(model, optimizer):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    traced = tidal.estimate(lambda: transformers.LlamaForCausalLM(config), budget="8GiB",
                            step=step)
    analytic = tidal.estimate(config, 2, 64, budget="8GiB", optimizer_step="device")
    assert traced.parameters == analytic.parameters
    assert traced.fits and analytic.fits


def test_a_step_that_cannot_run_on_fake_tensors_is_said():
    def step(model, optimizer):
        h = model(torch.randn(4, 3, 32, 32))
        h[h.nonzero()[:, 0]].sum().backward()

    with pytest.raises(tidal.InvalidArgument, match="fake tensors"):
        tidal.estimate(_cnn, budget="1GiB", step=step)
