"""Shared pieces of the per-family parity tests (test_models, test_model_families, test_moe, test_qwen35): a
transformers model with weights far from init, a left-padded batch, the float32 logits and packing checks, the
uncached greedy loop the engine must equal (on the CPU and under CUDA graphs), and the export check. Each test
module builds its own tiny configs."""
from __future__ import annotations

import torch
import transformers

from phaserl.models import CausalLM, save_pretrained
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 8, 9, 10], [11], [12, 13, 14, 15, 16]]  # lengths 3, 7, 1, 5


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights far from init (norms != 1, biases != 0, Gemma 4's layer scales != 1) so that a misplaced norm,
    bias, scale or window changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + 0.15 * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, a checkpoint buffer
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return module.eval()


def left_padded_batch(vocab: int):
    """ids [3, 9], mask [3, 9] (left padding of 3, 0 and 1), positions [3, 9] from the mask."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 9), generator=g)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9, [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by a full forward over the whole sequence at every step (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            seq.append(int(model.logits(model(torch.tensor([seq], device=model.output_weight.device)))[0, -1].argmax()))
    return seq[len(prompt):]


def assert_logits_match(hf, ours, batch) -> None:
    """Our float32 logits equal transformers' on batch's real tokens (positions derived from the mask)."""
    ids, mask, positions = batch
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = ours.logits(ours(ids, attention_mask=mask))
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def assert_packing_matches(ours, batch) -> None:
    """batch's rows packed into one sequence (seq_ids, positions restarting) give the padded rows' hidden states."""
    ids, mask, _ = batch
    lengths = mask.sum(-1).tolist()
    rows = [ids[i, mask[i].bool()] for i in range(len(ids))]
    packed = torch.cat(rows)[None]  # [1, N]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask)[mask.bool()]  # [N, H]
        got = ours(packed, position_ids=positions, seq_ids=seq_ids)[0]
    torch.testing.assert_close(got, padded, atol=1e-5, rtol=1e-5)


def assert_engine_greedy_matches(model, config: EngineConfig = EngineConfig(), new_tokens: int = 8):
    """The engine's greedy answers to PROMPTS equal the uncached loop's; returns the engine's result."""
    engine = RolloutEngine(model, config)
    result = engine.generate(PROMPTS, SamplingParams(max_new_tokens=new_tokens, temperature=0.0), eos_token_ids=[],
                             pad_token_id=0)
    assert result.response_ids == [greedy_reference(model, p, new_tokens) for p in PROMPTS]
    return result


def assert_graph_greedy_matches_on_gpu(ours, **engine_config) -> None:
    """On CUDA, with graphs: PROMPTS x 5 (20 sequences through 8 slots: refill, several buckets) decode greedily
    as the uncached loop does."""
    model = CausalLM(ours.config).cuda()
    model.load_state_dict(ours.state_dict())
    model.eval()
    prompts = PROMPTS * 5
    engine = RolloutEngine(model, EngineConfig(max_slots=8, token_budget=4096, **engine_config))
    result = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0), eos_token_ids=[],
                             pad_token_id=0)
    assert engine.last_stats["graphs"] > 1
    reference = {tuple(p): greedy_reference(model, p, 8) for p in PROMPTS}
    assert result.response_ids == [reference[tuple(p)] for p in prompts]


def assert_export_matches(hf, ours, directory, batch) -> None:
    """save_pretrained(ours) loads in AutoModelForCausalLM as hf's class, with hf's logits on batch's real tokens."""
    save_pretrained(ours, directory)
    back = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(back) is type(hf)
    ids, mask, positions = batch
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = back(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=1e-6, rtol=1e-6)
