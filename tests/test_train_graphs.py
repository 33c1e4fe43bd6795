"""ppo.train_graphs (roles/train_graphs.py): packed training micro-batches' decoder body as CUDA graph replays.

On the CPU: the static shapes and the padded inputs by hand, where the graphs run and the setting's choice. On the
GPU (`gpu`): graphed and eager micro-batches give the same log-probs and gradients, compiled or not, over several
shapes; forward-only passes are never graphed; moved parameters drop the graphs; a trainer step runs with them.
"""
import pytest
import torch

from phaserl.packing import pack_rows
from phaserl.roles import train_graphs
from phaserl.roles.forward import rows_logprobs, split_rows
from phaserl.roles.train_graphs import PaddedShape, TrainGraphs, padded_inputs, padded_shape, unsupported
from test_packing import _batch
from test_train_perf import _assert_grads_close, _gpu_model, _model, _to_cuda


def test_a_micro_batch_is_padded_to_rounded_tokens_slots_and_sequence_length():
    # 1,500 tokens in 7 rows, longest 300: T = 2,048, max_len = 384, padding 548 = 2 sequences, 9 -> 16 slots
    assert padded_shape(1500, 7, 300) == PaddedShape(tokens=2048, slots=16, max_len=384)
    assert padded_shape(2048, 16, 128) == PaddedShape(2048, 16, 128)  # no padding: no padding sequence
    assert padded_shape(1, 1, 1) == PaddedShape(1024, 16, 128)  # 1,023 padding tokens in 8 sequences of <= 128
    # the run's longest sequence sets max_len for every micro-batch; padding sequences stay <= 512 tokens
    shape = padded_shape(1500, 7, 300, run_longest=1000)
    assert shape == PaddedShape(2048, 16, 1024) and shape.pad_len == 512
    # slots: rows + padding sequences rounded up to a power of two
    assert padded_shape(12000, 30, 384).slots == 32 and padded_shape(12000, 40, 384).slots == 64


def test_the_padding_is_whole_sequences_after_the_rows(monkeypatch):
    monkeypatch.setattr(train_graphs, "TOKEN_STEP", 32)
    monkeypatch.setattr(train_graphs, "LENGTH_STEP", 8)
    monkeypatch.setattr(train_graphs, "MIN_SLOTS", 4)
    b = _batch([3, 2], [4, 1])  # real lengths 7 and 3: 10 tokens
    packed = pack_rows(b, torch.tensor([0, 1]))
    shape = padded_shape(packed.num_tokens, 2, packed.max_len)
    assert shape == PaddedShape(tokens=32, slots=8, max_len=8)  # 22 padding tokens: 3 sequences of 8, 8, 6
    ids, positions, cu = padded_inputs(packed, shape)
    assert ids.shape == positions.shape == (1, 32) and cu.dtype == torch.int32
    assert torch.equal(ids[0, :10], packed.input_ids[0]) and not ids[0, 10:].any()
    assert positions[0, :10].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert positions[0, 10:].tolist() == list(range(8)) * 2 + list(range(6))
    assert cu.tolist() == [0, 7, 10, 18, 26, 32, 32, 32, 32]  # rows, padding sequences, then empty ones
    monkeypatch.setattr(train_graphs, "PAD_CHUNK", 4)  # padding sequences shorter than max_len: 4, 4, 4, 4, 4, 2
    shape = padded_shape(packed.num_tokens, 2, packed.max_len)
    assert shape == PaddedShape(tokens=32, slots=8, max_len=8) and shape.pad_len == 4
    ids, positions, cu = padded_inputs(packed, shape)
    assert positions[0, 10:].tolist() == list(range(4)) * 5 + [0, 1]
    assert cu.tolist() == [0, 7, 10, 14, 18, 22, 26, 30, 32]


def test_graphs_run_only_on_cuda_for_the_dense_decoder():
    from phaserl.models.lora import LoRASettings, apply_lora

    assert unsupported(_model()).startswith("CPU")
    assert "not phaserl's decoder" in unsupported(torch.nn.Linear(2, 2))
    model = _model()
    model.model.gradient_checkpointing = True
    assert unsupported(model) == "activation checkpointing"
    model = _model()
    apply_lora(model, LoRASettings(rank=2, alpha=4.0))
    assert unsupported(model).startswith("LoRA adapters")


def test_train_graphs_true_on_the_cpu_is_a_warning_and_off(caplog):
    from phaserl.trainer.speed import train_graphs_choice

    class Actor:
        model, packing = _model(), True

    choice = train_graphs_choice(True, Actor(), world_size=1)
    assert choice.value is False and "ignored" in choice.why and "ppo.train_graphs=true is ignored" in caplog.text
    auto = train_graphs_choice(None, Actor(), world_size=1)
    assert auto.value is False and auto.asked is None and auto.why.startswith("CPU")
    assert "2 ranks" in train_graphs_choice(True, Actor(), world_size=2).why


# ----- GPU ---------------------------------------------------------------------------------------------------
def _graphed_loss_and_grads(model, batch, graphs, budget):
    model.zero_grad(set_to_none=True)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(5)).cuda()
    total, logps = 0.0, []
    for idx in split_rows(batch, budget, packing=True):
        logp, ent, mask = rows_logprobs(model, batch, idx, packing=True, temperature=0.8, with_entropy=True,
                                        graphs=graphs)
        loss = (logp * weights[idx.cuda()][:, : mask.shape[1]] * mask).sum() - 0.1 * (ent * mask).sum()
        loss.backward()
        total += float(loss.detach())
        logps.append(logp.detach())
    return total, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}, logps


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_graphed_micro_batches_give_the_eager_log_probs_and_gradients(compiled):
    from phaserl.models import decoder

    b = _to_cuda(_batch([7, 60, 3, 120, 33, 1, 90, 5], [90, 1, 40, 7, 64, 128, 30, 200], seed=3))
    model = _gpu_model(torch.bfloat16)
    if compiled:
        decoder.enable_compile(model)
    assert unsupported(model) == ""
    graphs = TrainGraphs(model)
    for budget in (300, 700, 2000):  # several micro-batch shapes, captured one by one
        loss, grads, logps = _graphed_loss_and_grads(model, b, None, budget)
        for replay in range(2):  # the first call captures, the second replays
            g_loss, g_grads, g_logps = _graphed_loss_and_grads(model, b, graphs, budget)
            assert g_loss == pytest.approx(loss, rel=2e-2, abs=0.5), (budget, replay)
            _assert_grads_close(g_grads, grads, 2e-2)
            for a, e in zip(g_logps, logps):
                assert (a - e).abs().max() < 0.05
    assert 2 <= len(graphs.graphs) <= 6
    assert graphs.pool_bytes > 0  # the pool the allocator's peak leaves out
    with torch.no_grad():  # forward-only passes: never graphed
        assert graphs.hidden(pack_rows(b, torch.tensor([0, 1]))) is None


@pytest.mark.gpu
def test_gpu_a_replaced_parameter_drops_the_graphs():
    b = _to_cuda(_batch([7, 60, 3], [90, 1, 40], seed=1))
    model = _gpu_model(torch.bfloat16)
    graphs = TrainGraphs(model)
    _graphed_loss_and_grads(model, b, graphs, 2000)
    assert len(graphs.graphs) == 1
    norm = model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 2)  # a new tensor, not a copy into the old one
    loss, grads, _ = _graphed_loss_and_grads(model, b, None, 2000)
    g_loss, g_grads, _ = _graphed_loss_and_grads(model, b, graphs, 2000)
    assert g_loss == pytest.approx(loss, rel=2e-2, abs=0.5)
    _assert_grads_close(g_grads, grads, 2e-2)
    assert len(graphs.graphs) == 1 and graphs.pointers[-1] == norm.weight.data_ptr()


@pytest.mark.gpu
def test_gpu_a_trainer_step_runs_with_train_graphs(tmp_path):
    import json
    import os

    from _tiny_run import make_run_dir
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    cfg = load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[jsonl]", "trainer.total_steps=2", "data.val_files=[]", "trainer.device=cuda",
        "rollout.engine_compile=false", "ppo.packing=true", "ppo.train_graphs=true", "model.dtype=bfloat16"])
    trainer = RLTrainer.from_config(cfg)
    assert trainer.run.speed.train_graphs.value is True and trainer.actor.train_graphs is not None
    trainer.fit()
    assert trainer.actor.train_graphs.graphs  # the update ran through captured graphs
    lines = [json.loads(x) for x in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
    assert all(torch.isfinite(torch.tensor(line["actor/grad_norm"])) for line in lines)
    # the step's peak counts the graphs' pool, which torch.cuda.max_memory_allocated never sees
    assert lines[-1]["perf/peak_memory_gb"] * 2**30 > trainer.actor.train_graphs.pool_bytes > 0
