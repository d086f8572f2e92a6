"""One rank of the FSDP2 test (test_fsdp.py): trains the same model, sharded with
torch.distributed.fsdp.fully_shard over a CPU device mesh (gloo), in each of the modes given
("none,activations", "none,plan"), each with its own Session and store directory, and writes the
losses. Launched with the env:// variables torchrun sets (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK): fsdp_worker.py STORE_ROOT OUT_JSON MODES."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import batches, loop_step, make_mlp  # noqa: E402
from rank_worker import finish, rank_session, rank_store_dir  # noqa: E402

STEPS = 6
WIDTH = 512


def rank_batches(rank):
    return batches(seed=100 + rank, steps=STEPS)


def make_fsdp(mesh):
    """FSDP2: each Linear its own group (reshard after forward), the root around them."""
    model = make_mlp(seed=5, width=WIDTH)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def gradient_error(mesh):
    """FSDP2's first gradients against one process's on both ranks' batches: the largest
    difference. A reduce-scatter that summed instead of averaging (gloo's AVG once did,
    pytorch#162338) would be off by the gradients themselves."""
    model = make_fsdp(mesh)
    x, y = rank_batches(dist.get_rank())[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    ref = make_mlp(seed=5, width=WIDTH)
    both = [rank_batches(r)[0] for r in range(dist.get_world_size())]
    torch.nn.functional.cross_entropy(
        ref(torch.cat([b[0] for b in both])), torch.cat([b[1] for b in both])).backward()
    return max((p.grad.full_tensor() - q.grad).abs().max().item()
               for p, q in zip(model.parameters(), ref.parameters()))


def train(mode, store_root, mesh):
    model = make_fsdp(mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = rank_session(mode, store_root, model, opt)
    losses, written, read, misses = [], 0, 0, 0
    for x, y in rank_batches(dist.get_rank()):
        loss = loop_step(model, opt, x, y, session)
        if session:
            st = session.stats()
            written += st.bytes_written
            read += st.bytes_read
            misses += st.misses
        losses.append(loss.item())
    out = {"losses": losses, "bytes_written": written, "bytes_read": read, "misses": misses}
    if session:
        st = session.stats()
        out.update(state=st.state, plan_summary=st.plan_summary, notice=st.notice,
                   write_failures=st.write_failures)
        out.update(rank_store_dir(store_root, mode))
    return out


def main():
    store_root, out_path, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(),
              "grad_error": gradient_error(mesh)}
    for mode in modes:
        result[mode] = train(mode, store_root, mesh)
    finish(result, out_path)


if __name__ == "__main__":
    main()
