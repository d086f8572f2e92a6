"""The random decoder shapes of bench/shape_fuzz.sh, shared with scripts/behaviour_snapshot.py.

draw(rng, max_layers) draws one shape; simulate_args(shape, order) is its `tidal simulate` model and
hardware arguments (the h100-4ssd preset with the shape's SSDs and host memory).
"""


def draw(rng, max_layers):
    head_dim = rng.choice([64, 128])
    heads = rng.choice([8, 12, 16, 24, 32, 40, 48, 64])
    hidden = heads * head_dim
    kv = rng.choice([k for k in (1, 2, 4, 8, heads) if heads % k == 0])
    tp = rng.choice([1, 2])
    if heads % tp or kv % tp:
        tp = 1
    ffn = int(hidden * rng.uniform(2.5, 4.0)) // 256 * 256
    vocab = rng.choice([32000, 50304, 49152, 128256])
    batch = rng.choice([1, 2, 4, 8, 16, 32])
    micro = rng.choice([m for m in (1, 2, 4) if batch % m == 0])
    return {
        "layers": rng.randint(4, max_layers), "hidden": hidden, "heads": heads, "kv_heads": kv,
        "ffn": ffn, "vocab": vocab, "batch": batch, "seq": rng.choice([512, 1024, 2048, 4096]),
        "micro_batches": micro, "precision": rng.choice(["fp32", "bf16-mixed"]),
        "tensor_parallel": tp, "ssds": rng.randint(1, 4),
        "host": rng.choice(["0", "64GB", "128GB", "256GB", "512GB", "1TB"]),
    }


def simulate_args(s, order):
    args = ["--model", "llama3-8b", "--layers", str(s["layers"]),
            "--hidden", str(s["hidden"]), "--heads", str(s["heads"]),
            "--kv-heads", str(s["kv_heads"]), "--ffn", str(s["ffn"]), "--vocab", str(s["vocab"]),
            "--batch", str(s["batch"]), "--seq", str(s["seq"]),
            "--micro-batches", str(s["micro_batches"]), "--precision", s["precision"],
            "--tensor-parallel", str(s["tensor_parallel"]), "--hardware", "h100-4ssd",
            "--ssd", f"{s['ssds']}x6.5/6.7GB/s", "--host-mem", s["host"]]
    if s["micro_batches"] > 1:
        args += ["--micro-batch-order", order]
    return args
