"""A vision-language GRPO step and rollout throughput: phaserl against TRL's GRPOTrainer (when trl imports) and
transformers' generate, on a Qwen2.5-VL-3B-shaped model (or --shape qwen3-vl-4b) with random weights, one image per
prompt.

Shape: Qwen2.5-VL-3B's architecture (language model 2048 wide, 36 layers, 16 query / 2 key-value heads, MLP 11008,
vocabulary 151,936, tied embeddings, M-RoPE sections (16, 24, 24); vision tower 32 blocks of 1280, windows of 112
pixels with full attention at blocks 7/15/23/31, patch 14, 2 x 2 merge), bf16, random weights. Each prompt is
--prompt-len text tokens after one --image-side x --image-side noise picture (448: 32 x 32 patches, 256 image
tokens); --prompts prompts x --n samples, --new-tokens new tokens, temperature 1.
Everything is made locally (no hub): a word-level tokenizer with the vision tokens, the random model directory, a
Qwen2.5-VL (Qwen3-VL) processor directory over that tokenizer (made in TRL's process), parquet rows in verl's
multimodal schema (PNG bytes), and a cheap rule reward. One JSON line per measurement:
  measure=step      side=trl: one optimizer step of TRL's GRPOTrainer (its generate, reference pass and update),
                    timed by a callback between optimizer steps, in its own process (run first, so its memory is
                    back before ours starts; killed after --trl-timeout); a skipped line where trl does not import,
                    an error line (its first line) where TRL fails
  measure=rollout   side=ours|transformers: new tokens/s of one batch of --prompts x --n sampled responses (ours: the
                    builtin engine with images; transformers: Qwen2_5_VLForConditionalGeneration.generate, the same
                    prompts, pixels and sampling), seconds, peak memory
  measure=step      side=ours: one whole GRPO step (rollout + old-policy and reference log-probs + update, KL in the
                    loss) through RLTrainer.from_config, as `phaserl train` builds it; warm-up steps flagged
  measure=summary   per side: median seconds of the timed steps; ours/transformers rollout speed-up, TRL/ours step
                    speed-up
Same on ours and TRL: the model files, prompt ids (TRL's processor renders `<|vision_start|><|image_pad|>...
<|vision_end|> words`, checked against ours' count), pixels (phaserl's image processor inside TRL's processor),
reward; temperature 1, no top-k/top-p; --prompts x --n responses and one optimizer step per step (TRL accumulates
--micro-batch sequences at a time, ours trains micro-batches of --micro-batch x the sequence length tokens); KL in
the loss (k3, --beta); PPO clip 0.2, token-mean over the batch (TRL loss_type=dapo); AdamW --lr constant, weight
decay 0, grad clip 1.0; the vision tower and merger frozen; gradient checkpointing off. Differences by design:
ours computes old log-probs in an extra pass (TRL uses the detached current ones), and rolls out with its engine
(TRL: `generate` on the training model); TRL's reference is a second copy of the model.

    python benchmarks/vision_grpo.py                       # the 3B shape on one GPU
    python benchmarks/vision_grpo.py --tiny                # a CPU smoke run (seconds)
    python benchmarks/vision_grpo.py --skip-transformers --skip-trl   # ours only
    python benchmarks/vision_grpo.py --shape qwen3-vl-4b   # Qwen3-VL-4B's architecture
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_probes import engine_stats, json_or_none, memory_gib, reset_peak, sync, timed_step  # noqa: E402

BENCH = "vision_grpo"
PAD, EOS = "<pad>", "<eos>"
VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]  # ids 2, 3, 4
SHAPES = {
    "3b": dict(text=dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                         intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                         max_position_embeddings=32768, mrope_section=(16, 24, 24)),
               vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, window_size=112, fullatt_block_indexes=(7, 15, 23, 31))),
    "qwen3-vl-4b": dict(text=dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                  head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                                  rope_theta=5e6, max_position_embeddings=32768, mrope_section=(24, 20, 20),
                                  mrope_interleaved=True, model_type="qwen3", qk_norm=True, attention_bias=False),
                        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                                    out_hidden_size=2560, patch_size=16, family="qwen3_vl",
                                    hidden_act="gelu_pytorch_tanh", num_position_embeddings=2304,
                                    deepstack_visual_indexes=(5, 11, 17))),
    "tiny": dict(text=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=128, vocab_size=4096, tie_word_embeddings=True, rope_theta=1e4,
                           max_position_embeddings=2048, mrope_section=(2, 3, 3)),
                 vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                             patch_size=14, window_size=56, fullatt_block_indexes=(1,))),
    "tiny-qwen3": dict(text=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, intermediate_size=128, vocab_size=4096, tie_word_embeddings=True,
                                 rope_theta=1e4, max_position_embeddings=2048, mrope_section=(2, 3, 3),
                                 mrope_interleaved=True, model_type="qwen3", qk_norm=True, attention_bias=False),
                       vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                   patch_size=14, family="qwen3_vl", hidden_act="gelu_pytorch_tanh",
                                   num_position_embeddings=16, deepstack_visual_indexes=(0,))),
}


def emit(**record) -> None:
    print(json.dumps({"bench": BENCH, **record}), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized model and batch (smoke run)")
    p.add_argument("--shape", choices=["3b", "qwen3-vl-4b"], default="3b",
                   help="3b: Qwen2.5-VL-3B's architecture; qwen3-vl-4b: Qwen3-VL-4B's (deepstack, interleaved M-RoPE)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (32; --tiny 2)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (8; --tiny 2)")
    p.add_argument("--prompt-len", type=int, default=64, help="text tokens per prompt beside the image")
    p.add_argument("--image-side", type=int, default=None, help="pixels per image side (448; --tiny 56)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per response (256; --tiny 4)")
    p.add_argument("--steps", type=int, default=3, help="timed GRPO steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed GRPO steps first")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per training micro-batch on both "
                   "sides (8; --tiny 2): TRL per_device_train_batch_size, ours ppo.micro_batch_tokens = this x "
                   "the sequence length")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="ours: ppo.micro_batch_tokens instead")
    p.add_argument("--beta", type=float, default=0.001, help="KL coefficient (ours kl_coef, TRL beta)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--kv-fraction", type=float, default=0.25, help="ours: rollout.engine_memory_fraction")
    p.add_argument("--skip-transformers", action="store_true", help="no transformers generate baseline")
    p.add_argument("--skip-ours-step", action="store_true", help="rollout measurements only")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE", help="phaserl config override")
    p.add_argument("--skip-trl", action="store_true", help="no TRL GRPOTrainer side")
    p.add_argument("--steps-trl", type=int, default=None, help="timed TRL steps (default --steps)")
    p.add_argument("--warmup-trl", type=int, default=None, help="untimed TRL steps first (default --warmup)")
    p.add_argument("--trl-timeout", type=float, default=280.0, help="seconds before the TRL process is killed")
    p.add_argument("--trl-set", action="append", default=[], metavar="KEY=JSON", help="extra GRPOConfig keyword")
    p.add_argument("--trl-world", default=None, help=argparse.SUPPRESS)  # the TRL process: the world to read
    a = p.parse_args(argv)
    if a.tiny:
        a.shape = "tiny-qwen3" if a.shape == "qwen3-vl-4b" else "tiny"
    a.device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    a.prompts = a.prompts or (2 if a.tiny else 32)
    a.n = a.n or (2 if a.tiny else 8)
    a.image_side = a.image_side or (56 if a.tiny else 448)
    a.new_tokens = a.new_tokens or (4 if a.tiny else 256)
    a.micro_batch = a.micro_batch or (2 if a.tiny else 8)
    a.steps_trl = a.steps if a.steps_trl is None else a.steps_trl
    a.warmup_trl = a.warmup if a.warmup_trl is None else a.warmup_trl
    if (a.prompts * a.n) % a.micro_batch:
        p.error(f"--micro-batch {a.micro_batch} must divide the {a.prompts} x {a.n} sequences of a step (TRL "
                "accumulates whole micro-batches into one optimizer step)")
    return a


def image_tokens(a) -> int:
    """Tokens per image: one per merge x merge block of patches (the picture is resized to exactly its pixels)."""
    return (a.image_side // (SHAPES[a.shape]["vision"]["patch_size"] * 2)) ** 2


def sequence_len(a) -> int:
    """Prompt (vision start, image pads, vision end, the words) plus the response."""
    return image_tokens(a) + 2 + a.prompt_len + a.new_tokens


# ----- the synthetic world ------------------------------------------------------------------------------------------
def build_tokenizer(vocab_size: int):
    """Word-level: ids 0/1 pad/eos, 2-4 the vision tokens, id i >= 5 the word `t{i}`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{t: 2 + i for i, t in enumerate(VISION)}, **{f"t{i}": i for i in range(5, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens([PAD, EOS, *VISION])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, eos_token=EOS, unk_token=PAD)


# Qwen2.5-VL's image markup without its role markers: rendered and tokenized, a TRL prompt is the same ids as ours'
# "<image> words" row (vision start, the image pads, vision end, then the words).
CHAT_TEMPLATE = ("{%- for message in messages -%}{%- if message['content'] is string -%}{{ message['content'] }}"
                 "{%- else -%}{%- for part in message['content'] -%}"
                 "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|> "
                 "{% elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
                 "{%- endfor -%}{%- endif -%}{%- endfor -%}")
PROCESSORS = {"qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
              "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor")}


def processor_class(family: str):
    """transformers' processor class of the family. Without torchvision transformers builds no video processor and
    the processor's constructor insists on one, so there a subclass leaves the video slot out (images only)."""
    import transformers
    from transformers.utils import is_torchvision_available

    cls = getattr(transformers, PROCESSORS[family][0])
    if is_torchvision_available():
        return cls

    class ImagesOnly(cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = cls.__name__  # the saved directory names the family's class
    return ImagesOnly


def build_processor(tokenizer, shape: dict, pixels: int):
    """The family's processor over the word-level tokenizer: phaserl's image processor for this tower and picture
    size (so an image becomes as many image tokens as on ours), CHAT_TEMPLATE, a video processor where one can
    be built."""
    import transformers
    from transformers.utils import is_torchvision_available

    from phaserl.data.images import processor_for
    from phaserl.models.vision import VisionConfig

    vision = VisionConfig(**shape["vision"])
    family = shape["vision"].get("family", "qwen2_5_vl")
    parts = dict(image_processor=processor_for(vision, min_pixels=pixels, max_pixels=pixels), tokenizer=tokenizer,
                 chat_template=CHAT_TEMPLATE)
    if is_torchvision_available():
        parts["video_processor"] = getattr(transformers, PROCESSORS[family][1])(
            patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size)
    return processor_class(family)(**parts)


def world_paths(root: str) -> dict:
    return {"root": root, "model": os.path.join(root, "model"), "tokenizer": os.path.join(root, "tokenizer"),
            "processor": os.path.join(root, "processor"), "data": os.path.join(root, "train.parquet")}


def write_processor(a, paths: dict) -> None:
    """TRL's processor directory over the world's tokenizer (made in TRL's process: a transformers that cannot
    build it fails TRL's side alone)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])
    build_processor(tokenizer, SHAPES[a.shape], a.image_side * a.image_side).save_pretrained(paths["processor"])


def write_world(a, root: str) -> dict:
    """The random model directory, its tokenizer and the prompt rows; returns their paths."""
    from phaserl.data import write_records
    from phaserl.models import save_pretrained
    from phaserl.models.config import DecoderConfig
    from phaserl.models.qwen_vl import ImageTokenIds, VisionLM
    from phaserl.models.vision import VisionConfig
    from phaserl.world.vision_task import png_bytes

    shape = SHAPES[a.shape]
    tokenizer = build_tokenizer(shape["text"]["vocab_size"])
    text = {"model_type": "qwen2", "attention_bias": True, **shape["text"]}
    cfg = DecoderConfig(rms_norm_eps=1e-6, eos_token_id=1, pad_token_id=0, **text)
    torch.manual_seed(0)
    with torch.device(a.device):
        model = VisionLM(cfg, VisionConfig(**shape["vision"]), ImageTokenIds(3, 3, 2, 4))
    paths = world_paths(root)
    save_pretrained(model, paths["model"], dtype=torch.bfloat16 if a.device == "cuda" else torch.float32)
    tokenizer.save_pretrained(paths["tokenizer"])
    del model
    rng = np.random.default_rng(0)
    rows = []
    for i in range(a.prompts):
        words = " ".join(f"t{w}" for w in rng.integers(5, shape["text"]["vocab_size"], a.prompt_len))
        image = rng.integers(0, 256, (a.image_side, a.image_side, 3), dtype=np.uint8)
        rows.append({"prompt": f"<image> {words}", "images": [{"bytes": png_bytes(image)}],
                     "data_source": "synthetic", "reward_model": {"style": "rule", "ground_truth": ""},
                     "extra_info": {"index": i}})
    write_records(paths["data"], rows)
    return paths


def sevens(prompt, response, ground_truth, **row) -> float:
    """Rule reward: the share of the response's characters that are the digit 7 (as grpo_setup.sevens)."""
    return response.count("7") / max(len(response), 1)


# ----- phaserl --------------------------------------------------------------------------------------------------------
def ours_config(a, paths: dict, log_dir: str) -> dict:
    """The settings TRL's side also has are set to the same values (trl_config); the vision tower is frozen."""
    pixels = a.image_side * a.image_side
    return {
        "model": {"path": paths["model"], "tokenizer_path": paths["tokenizer"],
                  "dtype": "bfloat16" if a.device == "cuda" else "float32"},
        "data": {"train_files": [paths["data"]], "val_files": [],
                 "max_prompt_length": a.prompt_len + image_tokens(a) + 8,
                 "apply_chat_template": False, "shuffle": False, "min_pixels": pixels, "max_pixels": pixels},
        "rollout": {"prompts_per_step": a.prompts, "n": a.n, "batch_size": a.prompts, "max_new_tokens": a.new_tokens,
                    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "engine_max_slots": a.prompts * a.n,
                    "engine_memory_fraction": a.kv_fraction},
        "reward": {"functions": [{"name": f"{os.path.abspath(__file__)}:sevens", "weight": 1.0}]},
        "algorithm": {"adv_estimator": "grpo", "norm_adv_by_std": True, "kl_placement": "loss", "kl_estimator": "k3",
                      "kl_coef": a.beta},
        "actor": {"optim": {"lr": a.lr, "weight_decay": 0.0, "betas": [0.9, 0.999], "grad_clip": 1.0,
                            "warmup_steps": 0, "lr_schedule": "constant"},
                  "policy_loss": "ppo", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "dual_clip_c": None,
                  "loss_agg_mode": "token-mean", "entropy_coef": 0.0, "gradient_checkpointing": False},
        "ppo": {"num_mini_batches": 1, "epochs": 1,
                "micro_batch_tokens": a.micro_batch_tokens or a.micro_batch * sequence_len(a)},
        "trainer": {"total_steps": a.warmup + a.steps, "seed": 0, "device": a.device, "log_dir": log_dir,
                    "checkpoint_path": os.path.join(log_dir, "checkpoints"), "val_before_train": False,
                    "loggers": ["jsonl"], "resume": "never"},
    }


def run_ours(a, paths: dict, log_dir: str) -> dict:
    import yaml

    from phaserl.config import load_config
    from phaserl.rollout import SamplingParams
    from phaserl.trainer import RLTrainer

    os.makedirs(log_dir, exist_ok=True)
    cfg_path = os.path.join(log_dir, "ours.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(ours_config(a, paths, log_dir), f, sort_keys=False)
    t0 = time.perf_counter()
    trainer = RLTrainer.from_config(load_config(cfg_path, a.ours_set))
    emit(measure="build", side="ours", seconds=round(time.perf_counter() - t0, 2), config=cfg_path,
         trainable_params=sum(p.numel() for p in trainer.actor.model.parameters() if p.requires_grad), **memory_gib())
    items = trainer.run.train_prompts.dataset.items[:a.prompts]
    prompts = [list(item.prompt_ids) for item in items for _ in range(a.n)]
    images = [item.images for item in items for _ in range(a.n)]
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0)
    actor = trainer.actor
    for attempt in ("warmup", "timed"):
        reset_peak()
        with actor.rollout_mode():
            sync()
            t0 = time.perf_counter()
            result = actor.generate(prompts, params, eos_token_ids=[1], pad_token_id=0, batch_size=len(prompts),
                                    generator=torch.Generator(actor.device).manual_seed(0), images=images)
            sync()
            seconds = time.perf_counter() - t0
        new = sum(map(len, result.response_ids))
        emit(measure="rollout", side="ours", warmup=attempt == "warmup", seconds=round(seconds, 3), new_tokens=new,
             tokens_per_s=round(new / seconds, 1), image_tokens_per_prompt=items[0].images.num_tokens,
             engine=engine_stats(actor), **memory_gib())
    out = {"rollout_tokens_per_s": round(new / seconds, 1)}
    if a.skip_ours_step:
        return out
    steps = []
    for i in range(a.warmup + a.steps):
        reset_peak()
        metrics, seconds = timed_step(trainer)
        if i >= a.warmup:
            steps.append(seconds)
        emit(measure="step", side="ours", step=i, warmup=i < a.warmup, seconds=round(seconds, 3),
             response_length_mean=metrics.get("train/response_length_mean"),
             reward_mean=metrics.get("train/reward_mean"), kl=metrics.get("train/kl"),
             timing_s={k.split("/", 1)[1]: round(v, 3) for k, v in metrics.items() if k.startswith("timing_s/")},
             **memory_gib())
    out["step_seconds_median"] = round(statistics.median(steps), 3) if steps else None
    return out


# ----- transformers generate --------------------------------------------------------------------------------------
def run_transformers(a, paths: dict) -> dict:
    from phaserl.data import load_prompt_rows
    from phaserl.data.images import build_vision_dataset, image_processor
    from phaserl.models import load_tokenizer

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = hf_model_class(a).from_pretrained(paths["model"], dtype=dtype).to(a.device).eval()
    tokenizer = load_tokenizer(paths["tokenizer"])
    vision = model.config.vision_config
    pixels = a.image_side * a.image_side
    processor = image_processor(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                                min_pixels=pixels, max_pixels=pixels)  # the same pixels as ours: mean/std aside
    items = build_vision_dataset(load_prompt_rows([paths["data"]])[:a.prompts], tokenizer, processor,
                                 merge_size=vision.spatial_merge_size, max_prompt_length=10**6, overlong="error",
                                 apply_chat_template=False).items
    ids = torch.tensor([list(item.prompt_ids) for item in items for _ in range(a.n)], device=a.device)  # equal lengths
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  pixel_values=torch.cat([item.images.pixel_values for item in items for _ in range(a.n)]).to(
                      a.device, dtype),
                  image_grid_thw=torch.tensor([g for item in items for _ in range(a.n) for g in item.images.grids],
                                              device=a.device),
                  mm_token_type_ids=(ids == 3).int())
    out = {}
    for attempt in ("warmup", "timed"):
        reset_peak()
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            try:
                generated = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                           max_new_tokens=a.new_tokens, pad_token_id=0, eos_token_id=1)
            except (TypeError, ValueError):  # a transformers without mm_token_type_ids: positions from the grids
                inputs.pop("mm_token_type_ids")
                generated = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                           max_new_tokens=a.new_tokens, pad_token_id=0, eos_token_id=1)
        sync()
        seconds = time.perf_counter() - t0
        responses = generated[:, ids.shape[1]:].tolist()  # up to and with the first EOS: the sampled tokens
        new = sum(r.index(1) + 1 if 1 in r else len(r) for r in responses)
        emit(measure="rollout", side="transformers", warmup=attempt == "warmup", seconds=round(seconds, 3),
             new_tokens=new, tokens_per_s=round(new / seconds, 1), **memory_gib())
        out = {"rollout_tokens_per_s": round(new / seconds, 1)}
    del model
    return out


# ----- TRL -------------------------------------------------------------------------------------------------------
def hf_model_class(a):
    import transformers

    family = SHAPES[a.shape]["vision"].get("family", "qwen2_5_vl")
    return {"qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
            "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[family]


def trl_rows(path: str):
    """The parquet rows as TRL reads a vision dataset: the words as one user message, the picture in `image`."""
    import io

    import pyarrow.parquet as pq
    from datasets import Dataset
    from PIL import Image

    rows = pq.read_table(path, columns=["prompt", "images"]).to_pylist()
    prompts = [[{"role": "user", "content": r["prompt"].removeprefix("<image> ")}] for r in rows]
    images = [Image.open(io.BytesIO(r["images"][0]["bytes"])).convert("RGB") for r in rows]
    return Dataset.from_dict({"prompt": prompts, "image": images})


def trl_sevens(prompts, completions, **kwargs) -> list:
    """`sevens` in TRL's signature: a conversational completion is a list of messages."""
    return [sevens(None, c[-1]["content"] if isinstance(c, list) else c, None) for c in completions]


def run_trl(a, paths: dict) -> None:
    """TRL's GRPOTrainer on the world's model, processor and rows (this process runs nothing else): one line per
    optimizer step. An error becomes a line (its first line), so the other sides still report."""
    try:
        _run_trl(a, paths)
    except Exception as error:  # an OOM, or a TRL/transformers version that rejects this setup: report, go on
        emit(measure="step", side="trl", error=f"{type(error).__name__}: {str(error).strip()}".splitlines()[0][:500])


def _run_trl(a, paths: dict) -> None:
    import trl
    from trl import GRPOConfig, GRPOTrainer

    from grpo_step import trl_config

    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model = hf_model_class(a).from_pretrained(paths["model"], dtype=dtype)
    model.model.visual.requires_grad_(False)  # as ours: the tower and its merger frozen
    write_processor(a, paths)
    processor = processor_class(SHAPES[a.shape]["vision"].get("family", "qwen2_5_vl")).from_pretrained(
        paths["processor"])
    rows = trl_rows(paths["data"])
    prompt_tokens = check_trl_prompt(a, processor, rows[0])
    # trl_config reads grpo_step's names: the prompt is the image's tokens, its two markers and the words
    matched = argparse.Namespace(**{**vars(a), "prompt_len": prompt_tokens, "gradient_checkpointing": False})
    kwargs, dropped = trl_config(matched, GRPOConfig, os.path.join(paths["root"], "trl"))
    done: list = []  # per generation batch: completion lengths (tokens) and the mean reward

    def reward(prompts, completions, completion_ids=None, **kw):
        scores = trl_sevens(prompts, completions)
        done.append(([len(x) for x in completion_ids or []], sum(scores) / len(scores)))
        return scores

    reward.__name__ = "sevens"
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=GRPOConfig(**kwargs), train_dataset=rows,
                          processing_class=processor, callbacks=[trl_step_timer(a, done)])
    emit(measure="build", side="trl", trl=trl.__version__, seconds=round(time.perf_counter() - t0, 2),
         prompt_tokens=prompt_tokens, image_tokens_per_prompt=image_tokens(a), micro_batch=a.micro_batch,
         accumulation=kwargs.get("gradient_accumulation_steps"), config_dropped=dropped,
         trainable_params=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad), **memory_gib())
    trainer.train()


def check_trl_prompt(a, processor, row) -> int:
    """Row 0's prompt length as TRL's processor tokenizes it; a ValueError unless it is ours' (the same image tokens
    and words), since the sides would not be doing the same work."""
    message = [{"role": "user", "content": [{"type": "image", "image": row["image"]},
                                            {"type": "text", "text": row["prompt"][0]["content"]}]}]
    first = processor.apply_chat_template(conversation=[message], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)
    ids = [int(t) for t in first["input_ids"][0]]
    ours = image_tokens(a) + 2 + a.prompt_len
    if len(ids) != ours or ids.count(3) != image_tokens(a):
        raise ValueError(f"TRL's processor made {len(ids)} prompt tokens ({ids.count(3)} image tokens) of row 0; "
                         f"ours has {ours} ({image_tokens(a)})")
    return len(ids)


def trl_step_timer(a, done: list):
    """A TrainerCallback that prints one step line per optimizer step: the seconds since the previous one (a
    step's generation runs inside its first micro-step), its peak memory, and what the reward saw (`done`)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            sync()
            reset_peak()
            self.last, self.step = time.perf_counter(), 0

        def on_step_end(self, args, state, control, **kw):
            sync()
            lengths, reward_mean = done[self.step] if self.step < len(done) else ([], None)
            emit(measure="step", side="trl", step=self.step, warmup=self.step < a.warmup_trl,
                 seconds=round(time.perf_counter() - self.last, 3),
                 response_length_mean=sum(lengths) / len(lengths) if lengths else None, reward_mean=reward_mean,
                 **memory_gib())
            reset_peak()
            self.last, self.step = time.perf_counter(), self.step + 1

    return StepTimer()


def trl_side(a, argv: list, root: str) -> dict:
    """TRL in its own process on the world in `root` (its memory is returned to the device before ours runs, and a
    hang is killed after --trl-timeout); its lines are passed through. Returns its summary."""
    import importlib.util
    import subprocess
    import threading

    if importlib.util.find_spec("trl") is None:
        emit(measure="step", side="trl", skipped="trl is not installed on this machine: no TRL GRPOTrainer step")
        return {"skipped": "trl is not installed"}
    command = [sys.executable, os.path.abspath(__file__), *argv, "--trl-world", root]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(a.trl_timeout, process.kill)
    watchdog.start()
    timed, peaks, error = [], [], None
    try:
        for line in process.stdout:
            record = json_or_none(line)
            print(line, end="", flush=True, file=sys.stdout if record else sys.stderr)  # TRL's own log dicts: aside
            if record and record.get("side") == "trl" and record.get("measure") == "step":
                error = record.get("error", error)
                if "seconds" in record and not record["warmup"]:
                    timed.append(record["seconds"])
                peaks.append(record.get("peak_allocated_gib") or 0.0)
        process.wait()
    finally:
        watchdog.cancel()
    if process.returncode != 0:  # the steps it finished still count
        error = (f"killed after --trl-timeout {a.trl_timeout:.0f} s" if process.returncode == -9
                 else f"the TRL process exited with {process.returncode} (its stderr above)")
        emit(measure="step", side="trl", error=error)
    out = {"step_seconds_median": round(statistics.median(timed), 3) if timed else None, "steps_timed": len(timed),
           "peak_allocated_gib": max(peaks, default=0.0) or None}
    return {**out, "error": error} if error else out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parse_args(argv)
    torch.manual_seed(0)
    if a.trl_world:  # the TRL process that trl_side starts
        run_trl(a, world_paths(a.trl_world))
        return
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        paths = write_world(a, root)
        emit(measure="setup", shape=a.shape, device=a.device, prompts=a.prompts, n=a.n, prompt_len=a.prompt_len,
             image_side=a.image_side, new_tokens=a.new_tokens, micro_batch=a.micro_batch,
             sequence_len=sequence_len(a), seconds=round(time.perf_counter() - t0, 1))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the model was made on the GPU; the TRL process needs the memory
        summary = {}
        if not a.skip_trl:  # first: its own process, while this one holds next to nothing on the device
            summary["trl"] = trl_side(a, argv, root)
        if not a.skip_transformers:
            summary["transformers"] = run_transformers(a, paths)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        summary["ours"] = run_ours(a, paths, os.path.join(root, "ours"))
        if "transformers" in summary:
            summary["rollout_speedup"] = round(summary["ours"]["rollout_tokens_per_s"]
                                               / summary["transformers"]["rollout_tokens_per_s"], 2)
        ours_s, trl_s = summary["ours"].get("step_seconds_median"), summary.get("trl", {}).get("step_seconds_median")
        if ours_s and trl_s:
            summary["step_speedup_vs_trl"] = round(trl_s / ours_s, 2)
            summary["step_speedup_ge_3x"] = trl_s >= 3 * ours_s
        emit(measure="summary", **summary)


if __name__ == "__main__":
    main()
