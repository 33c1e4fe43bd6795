"""AdamW state offload for the hybrid switch (roles/optim.py): GPU memory really freed, values back exactly."""
import pytest
import torch

from phaserl.roles.optim import Optimizer, OptimSettings

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _stepped_optimizer(model):
    opt = Optimizer(model.parameters(), OptimSettings(lr=1e-3))
    model(torch.randn(4, 256, device="cuda")).square().sum().backward()
    opt.step()
    return opt


def _moments(opt):
    return [v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
            for st in opt.opt.state.values() for k, v in st.items() if k != "step"]


def _offload_roundtrip(model):
    opt = _stepped_optimizer(model)
    before, state_bytes = _moments(opt), sum(t.numel() * t.element_size() for t in _moments(opt))
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    opt.offload_state("cpu")
    torch.cuda.synchronize()
    freed = allocated - torch.cuda.memory_allocated()
    opt.offload_state("cuda")
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated
    for a, b in zip(before, _moments(opt)):
        assert torch.equal(a, b)
    return freed, state_bytes


def test_plain_moments_leave_the_gpu_and_come_back_equal():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 1)).cuda()
    freed, state_bytes = _offload_roundtrip(model)
    assert freed >= state_bytes  # both moments of every parameter, released to the allocator


def test_fsdp_sharded_moments_leave_the_gpu_and_come_back_equal(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 1)).cuda()
        fully_shard(model)
        freed, state_bytes = _offload_roundtrip(model)
        assert freed >= state_bytes
    finally:
        dist.destroy_process_group()
