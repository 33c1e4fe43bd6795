"""Resume on another world size: a checkpoint written by one process resumes on 2 gloo ranks whose model is
sharded with FSDP2 (`fully_shard`), and what those 2 ranks save resumes (and exports) in one process.
torch.distributed.checkpoint does the resharding; these tests check the numbers survive it exactly."""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from _multiproc import free_port, start_method
from phaserl.checkpoint import Checkpointer, TrainingState, export_checkpoint
from phaserl.models import CausalLM, DecoderConfig
from phaserl.roles.optim import Optimizer, OptimSettings

pytestmark = pytest.mark.slow  # an end-to-end run (see README, "Tests")


def _role():
    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                        tie_word_embeddings=True, attention_bias=True, eos_token_id=1, pad_token_id=0)
    model = CausalLM(cfg)
    return SimpleNamespace(model=model, optimizer=Optimizer(model.parameters(), OptimSettings(lr=1e-2, warmup_steps=4)))


def _train_step(role, seed: int) -> None:
    ids = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(seed))  # [B, T]
    role.model(ids).square().mean().backward()
    role.optimizer.opt.step()
    role.optimizer.sched.step()
    role.optimizer.opt.zero_grad(set_to_none=True)


def _state(role, step: int, generator) -> TrainingState:
    return TrainingState(step=step, roles={"actor": role}, generators={"sampling": generator})


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _snapshot(role, generator) -> dict:
    """Full (unsharded) weights, AdamW moments, LR schedule and generator state, keyed by parameter name."""
    names = {id(p): n for n, p in role.model.named_parameters()}
    opt = role.optimizer.opt
    moments = {names[id(p)]: {k: _full(v).clone() for k, v in opt.state[p].items()} for p in opt.state}
    return {"weights": {n: _full(p.detach()).clone() for n, p in role.model.named_parameters()},
            "moments": moments, "scheduler": role.optimizer.sched.state_dict(), "rng": generator.get_state()}


def _assert_same(got: dict, want: dict) -> None:
    assert got["weights"].keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        assert torch.equal(got["weights"][name], value), f"weight {name}"
    assert got["moments"].keys() == want["moments"].keys()
    for name, st in want["moments"].items():
        for key, value in st.items():
            assert torch.equal(got["moments"][name][key], value), f"{key} of {name}"
    assert got["scheduler"] == want["scheduler"]


def _sharded_ranks(rank: int, world: int, port: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (world,))
        role = _role()
        for layer in role.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(role.model, mesh=mesh)
        role.optimizer = Optimizer(role.model.parameters(), role.optimizer.settings)  # over the sharded params
        assert role.model.model.layers[0].mlp.up_proj.weight.to_local().shape == (8, 8)   # really sharded
        generator = torch.Generator().manual_seed(100 + rank)
        ckpt = Checkpointer(root=os.path.join(root, "ckpt"), keep=2, resume_mode="auto", export_hf=False,
                            rank=rank, world_size=world)
        info = ckpt.resume(_state(role, 0, generator))
        assert info.step == 1 and info.metadata["world_size"] == 1
        _assert_same(_snapshot(role, generator), torch.load(os.path.join(root, "saved_by_1.pt"), weights_only=True))
        _train_step(role, seed=2)
        ckpt.save(_state(role, 2, generator))
        snap = _snapshot(role, generator)   # collective (full_tensor): every rank takes it
        if rank == 0:
            torch.save(snap, os.path.join(root, "saved_by_2.pt"))
    finally:
        dist.destroy_process_group()




def test_one_process_to_two_sharded_ranks_and_back(tmp_path):
    root = str(tmp_path)
    # 1 process: a step, then a checkpoint
    role, generator = _role(), torch.Generator().manual_seed(7)
    _train_step(role, seed=1)
    ckpt = Checkpointer(root=os.path.join(root, "ckpt"), keep=2, resume_mode="auto", export_hf=False)
    ckpt.save(_state(role, 1, generator))
    torch.save(_snapshot(role, generator), os.path.join(root, "saved_by_1.pt"))

    # 2 FSDP2 ranks: resume step 1 (checked inside), one more step, save step 2
    mp.start_processes(_sharded_ranks, args=(2, free_port(), root), nprocs=2, join=True, start_method=start_method())
    meta = os.path.join(root, "ckpt", "step_2", "metadata.json")
    assert '"world_size": 2' in open(meta).read()
    rng_files = sorted(os.listdir(os.path.join(root, "ckpt", "step_2", "rng")))
    assert rng_files == ["rank_0.safetensors", "rank_1.safetensors"]

    # 1 process again: resume step 2, equal to what the sharded ranks held, rank 0's RNG included
    role, generator = _role(), torch.Generator().manual_seed(7)
    ckpt = Checkpointer(root=os.path.join(root, "ckpt"), keep=2, resume_mode="auto", export_hf=False)
    assert ckpt.resume(_state(role, 0, generator)).step == 2
    want = torch.load(os.path.join(root, "saved_by_2.pt"), weights_only=True)
    _assert_same(_snapshot(role, generator), want)
    assert torch.equal(generator.get_state(), want["rng"])

    # and the sharded checkpoint exports as one Hugging Face directory
    from safetensors.torch import load_file

    out = export_checkpoint(os.path.join(root, "ckpt"), os.path.join(root, "hf"))
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert exported.keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        assert torch.equal(exported[name], value), name
