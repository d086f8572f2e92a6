"""FSDP2 (torch.distributed.fsdp.fully_shard) on two CPU ranks over gloo, launched with the
env:// variables as in test_distributed.py: with activation offloading and in plan mode every
rank's losses equal its losses without tidal, bit for bit."""

from test_distributed import launch_ranks

def launch(store_dir, modes, world=2, timeout=120):
    return launch_ranks("fsdp_worker.py", store_dir, lambda out: [store_dir, out, ",".join(modes)],
                        world, timeout)


def check(results, mode):
    assert [r["rank"] for r in results] == [0, 1]
    dirs = set()
    for r in results:
        # FSDP2 averages the gradients over the ranks (reference: one process on both ranks'
        # batches; a reduce-scatter that summed would be off by the gradients, ~1e-2).
        assert r["grad_error"] < 1e-6, r["grad_error"]
        ref = r["none"]["losses"]
        assert len(ref) == 6
        got = r[mode]
        assert got["losses"] == ref, f"rank {r['rank']} {mode}: {got['losses']} != {ref}"
        assert got["dir_exists"]
        assert got["write_failures"] == 0
        dirs.add(got["dir"])
    assert len(dirs) == 2  # one directory per rank, none shared
    # The ranks trained on different data: they are two real ranks, not one run twice.
    assert results[0]["none"]["losses"] != results[1]["none"]["losses"]


def test_fsdp2_activations_bit_identical(store_dir):
    check(launch(store_dir, ["none", "activations"]), "activations")


def test_fsdp2_plan_bit_identical(store_dir):
    results = launch(store_dir, ["none", "plan"])
    check(results, "plan")
    for r in results:
        assert r["plan"]["state"] == "executing"
        # Plan mode really moved something: bytes went to the store (and came back).
        assert r["plan"]["bytes_written"] > 0, f"rank {r['rank']}: {r['plan']}"
