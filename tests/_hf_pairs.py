"""Shared pieces of the per-family parity tests (test_models, test_model_families, test_moe, test_qwen35): a
transformers model with weights far from init, a left-padded batch, the uncached greedy loop the engine must
equal, and the export-reloads-with-the-same-logits check. Each test module builds its own tiny configs."""
from __future__ import annotations

import torch
import transformers

from phaserl.models import save_pretrained

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
