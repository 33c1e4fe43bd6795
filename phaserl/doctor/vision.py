"""The doctor's vision-row probe: a few real training rows with images through the whole path `train` takes.

For a vision-language policy (models/qwen_vl.VisionLM) it runs the rows through the one processor call per row
(data/images.py), then the training forward with their pixels and the rollout engine's prefill and first decode
step, and reports the image tokens per row (and their share of data.max_prompt_length), the pixel memory a row
carries through the step, and the vision tower's activation memory for the largest row. It fails when a row cannot
be read, when the forward or the engine reject a row (placeholder counts, grids), or when the two sides disagree on
the first sampled token's log-prob beyond the text families' tolerance. A text policy gets OK without a probe.
Not here: the processor and the model (data/, models/), the memory budget of a step (memory/).
"""
from __future__ import annotations

import torch

from ..data.images import build_vision_dataset, processor_for
from ..memory.budget import fmt_bytes
from ..rollout import RolloutEngine, SamplingParams
from .checks import Context, check
from .report import FAIL, OK, CheckResult

PROBE_ROWS = 4
LOGPROB_TOLERANCE = 1e-3  # float32 on the CPU agrees to ~1e-5; bf16 on a GPU to ~1e-2 of a nat at worst


@check("vision rows", needs=("tokenizer", "policy", "train_rows"))
def check_vision_rows(ctx: Context) -> CheckResult:
    model, d = ctx.policy, ctx.cfg.data
    if not getattr(model, "takes_images", False):
        return CheckResult("vision rows", OK, "text policy: no image rows to probe")
    processor = processor_for(model.vision_config, min_pixels=d.min_pixels, max_pixels=d.max_pixels)
    items = build_vision_dataset(ctx.train_rows[:PROBE_ROWS], ctx.tokenizer, processor,
                                 merge_size=model.vision_config.spatial_merge_size, max_prompt_length=10**9,
                                 overlong="error", apply_chat_template=d.apply_chat_template,
                                 image_key=d.image_key).items
    images = [item.images for item in items]
    tokens = [0 if im is None else im.num_tokens for im in images]
    pixels = [0 if im is None else im.nbytes for im in images]
    first = next((i for i, im in enumerate(images) if im is not None), None)
    if first is None:
        return CheckResult("vision rows", OK, f"the first {len(items)} training rows have no images")
    prompt, image = list(items[first].prompt_ids), images[first]
    result = RolloutEngine(model).generate([prompt], SamplingParams(max_new_tokens=1, temperature=1.0),
                                           eos_token_ids=[], pad_token_id=0, images=[image],
                                           generator=torch.Generator(ctx.device).manual_seed(0))
    token, sampled = result.response_ids[0][0], result.logprobs[0][0]
    with torch.no_grad():
        hidden = model(torch.tensor([prompt + [token]], device=ctx.device), images=[image])[0, len(prompt) - 1]
        trained = float(torch.log_softmax(model.logits(hidden).float(), -1)[token])
    largest = images[max(range(len(images)), key=lambda i: tokens[i])]
    v = model.vision_config
    # the tower's widest activations: the patches at the MLP width, q/k/v, and one attention group's scores
    patches = largest.pixel_values.shape[0]
    tower = patches * (v.intermediate_size * 2 + v.hidden_size * 4) * model.output_weight.element_size()
    line = (f"{len(items)} probe rows: image tokens per row {min(tokens)}-{max(tokens)} "
            f"(up to {max(tokens) / d.max_prompt_length:.0%} of data.max_prompt_length = {d.max_prompt_length}), "
            f"pixels {fmt_bytes(max(pixels))} per row (kept with the batch for every pass), vision tower activations "
            f"~{fmt_bytes(tower)} for the largest row; engine and training log-prob of the first sampled token: "
            f"{sampled:.4f} vs {trained:.4f}")
    if abs(sampled - trained) > LOGPROB_TOLERANCE:
        return CheckResult("vision rows", FAIL, line, fix="the engine and the training forward see different "
                                                          "image inputs; report this with the probe row")
    return CheckResult("vision rows", OK, line)
