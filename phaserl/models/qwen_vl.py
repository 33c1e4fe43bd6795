"""Qwen2.5-VL and Qwen3-VL on the native decoder: the vision tower's embeddings in place of the image placeholder
tokens, M-RoPE positions, Qwen3-VL's deepstack features, and the Hugging Face directory (config.json + safetensors)
in and out.

`VisionLM` is a CausalLM (the Qwen2 / Qwen3 decoder with `mrope_section` set, so the roles, LoRA, the rollout engine
and checkpoints treat it as one) plus `visual`, the tower of vision.py. Its forward takes `images`: per row, None (a
text row) or an object with `pixel_values` [N, F] and `grids` [(t, h, w), ...] (data.images.ImageInputs, one
processor call per row, and `starts`: where each image's placeholders begin in the row's ids, recorded where the
ids were made). It places each row's images on image segments (`<|vision_start|>`, a run of placeholders,
`<|vision_end|>`): image k on the segment at its recorded start, or, for images that record no starts (bare
ImageInputs given by hand), on the row's k-th segment; each run is checked against its image's token count (a
ValueError naming the row, never a silent shift). It embeds the tokens, writes the tower's output over those
placeholder rows, and runs the decoder at the rows' M-RoPE positions.
A sampled marker is text: a placeholder id outside the images' segments, or a whole segment no image is placed on,
is embedded and positioned as an ordinary token, here and in the rollout engine (whose decode embeds every sampled id
as text), so a policy that samples `<|image_pad|>` or `<|vision_start|>` gets the same log-prob on both sides, a
whole sampled segment before a later image observation included. The checks keep what the ids can decide: a recorded
start that is not a segment of its image's size, fewer starts or segments than images, or a run that differs from
its image's count, is the ids and pixels of different processor calls (the rule is mrope.place_images'). Whether a
row lost its pixels needs the ids' origin, which the model does not see: `check_pixels` takes it from the training
batch (the tokens the policy did not sample: the prompt and the observations), and the engine checks its prompts
and appended ids (rollout/images.py). Without recorded starts a sampled segment before an image would take its
place, which check_pixels refuses.
A row object shared by several rows (the n samples of a prompt) goes through the tower once. Without images the
model is its text decoder at plain RoPE positions (identical: mrope.py).
Files: Qwen2.5-VL's (transformers 4.x and 5.x) store `model.*` (the language model), `visual.*` and `lm_head.*`, our
parameter names; Qwen3-VL's store `model.language_model.*` and `model.visual.*` (families.py maps the names both
ways). config.json is written in transformers 5's form (text_config, vision_config). Qwen3-VL adds its deepstack
features (the tower's intermediate blocks, merged) to the hidden states of the image tokens after the decoder's
first k layers: `after_layer` in the training forward, `rollout/images.py` in the engine's prefill.
In the bitwise numerics mode (rollout.bitwise) the tower runs the invariant kernels (vision.py) and the decoder lays
its keys out by each token's place in its row, not by its M-RoPE position (models/invariant.Aligned.of), as the
engine's slots hold them.
Not here: the tower (vision.py), M-RoPE math (mrope.py), the image processor (data/images.py).

Legend: B rows, S tokens per row, H hidden, M image tokens of a call, L a prompt's tokens.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from phaserl.errors import ConfigError
from phaserl.models.config import DecoderConfig
from phaserl.models.decoder import CausalLM, init_weights
from phaserl.models.families import config_from_hf, config_to_hf
from phaserl.models.layers import embed
from phaserl.models.mrope import image_segments, place_images, span_positions
from phaserl.models.vision import VisionConfig, VisionTower, set_trainable

log = logging.getLogger("phaserl")
@dataclass(frozen=True)
class ImageTokenIds:
    """The special tokens of the family's prompt format (`<|vision_start|><|image_pad|>*n<|vision_end|>`)."""
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


@dataclass(frozen=True)
class VLFamily:
    text_model_type: str    # the native decoder family of the language model
    architecture: str       # transformers' *ForConditionalGeneration class
    vision_defaults: dict   # transformers' values for absent vision_config keys (which keys the family has)
    interleaved: bool       # M-RoPE sections interleaved over the frequencies (Qwen3-VL) or in blocks


_COMMON = dict(in_channels=3, temporal_patch_size=2, spatial_merge_size=2)
VL_FAMILIES = {
    "qwen2_5_vl": VLFamily("qwen2", "Qwen2_5_VLForConditionalGeneration", dict(
        _COMMON, depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
        patch_size=14, window_size=112, fullatt_block_indexes=(7, 15, 23, 31), hidden_act="silu"), False),
    "qwen3_vl": VLFamily("qwen3", "Qwen3VLForConditionalGeneration", dict(
        _COMMON, depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=3584,
        patch_size=16, num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24),
        hidden_act="gelu_pytorch_tanh"), True),
}
VL_MODEL_TYPES = tuple(VL_FAMILIES)
_TOKEN_DEFAULTS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                       vision_end_token_id=151653)


def vl_config_from_hf(d: dict, *, source: str = "config.json") -> tuple[DecoderConfig, VisionConfig, ImageTokenIds]:
    """The language model's DecoderConfig (the family's decoder with mrope_section), the tower's VisionConfig and
    the image token ids of a qwen2_5_vl / qwen3_vl config.json (text keys nested in text_config, or top-level in
    Qwen2.5-VL's 4.x files)."""
    model_type = d.get("model_type")
    if model_type not in VL_FAMILIES:
        raise ConfigError(f"{source}: model_type={model_type!r} is not a native vision-language model "
                          f"({', '.join(VL_MODEL_TYPES)})")
    family = VL_FAMILIES[model_type]
    text = dict(d.get("text_config") or d)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    interleaved = bool(rope.pop("mrope_interleaved", family.interleaved))
    if section is None:
        raise ConfigError(f"{source}: the text config's rope_parameters (or rope_scaling) has no mrope_section")
    if rope.get("rope_type", rope.get("type")) in (None, "mrope", "default"):
        rope = {k: v for k, v in rope.items() if k not in ("type", "rope_type")}
        rope["rope_type"] = "default"
    rope.setdefault("rope_theta", text.get("rope_theta", d.get("rope_theta", 1000000.0)))
    tie = d.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    text = {**text, "model_type": family.text_model_type, "rope_parameters": rope, "rope_scaling": None,
            "tie_word_embeddings": tie}
    cfg = config_from_hf(text, source=f"{source} (text_config)")
    try:
        cfg = cfg.replace(mrope_section=tuple(section), mrope_interleaved=interleaved)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    v = d.get("vision_config") or {}
    theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    vision = VisionConfig(**{k: v.get(k, default) for k, default in family.vision_defaults.items()},
                          rope_theta=float(theta), family=model_type)
    if vision.out_hidden_size != cfg.hidden_size:
        raise ConfigError(f"{source}: vision_config.out_hidden_size={vision.out_hidden_size} differs from the "
                          f"language model's hidden_size={cfg.hidden_size}")
    tokens = ImageTokenIds(**{k: d.get(k, text.get(k, default)) for k, default in _TOKEN_DEFAULTS.items()})
    return cfg, vision, tokens


def vl_config_to_hf(cfg: DecoderConfig, vision: VisionConfig, tokens: ImageTokenIds, dtype: str = "float32") -> dict:
    """A qwen2_5_vl / qwen3_vl config.json dict from which transformers builds the same network."""
    family = VL_FAMILIES[vision.family]
    text = config_to_hf(cfg.replace(mrope_section=None, mrope_interleaved=False), dtype)
    for key in ("architectures", "torch_dtype", "rope_theta", "rope_scaling", "layer_types", "use_sliding_window",
                "max_window_layers", "sliding_window"):
        text.pop(key, None)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "mrope_section": list(cfg.mrope_section)}
    if cfg.mrope_interleaved:
        rope["mrope_interleaved"] = True
    text.update(model_type=f"{vision.family}_text", rope_parameters=rope)
    v = {k: getattr(vision, k) for k in family.vision_defaults}
    v = {k: list(x) if isinstance(x, tuple) else x for k, x in v.items()}
    v.update(model_type=f"{vision.family}_vision",
             rope_parameters={"rope_type": "axial", "rope_theta": vision.rope_theta})
    return {"architectures": [family.architecture], "model_type": vision.family, "text_config": text,
            "vision_config": v, "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": dtype, **asdict(tokens)}


class VisionLM(CausalLM):
    """Qwen2.5-VL / Qwen3-VL: the text decoder (M-RoPE), a vision tower, and the image placeholders between them."""

    takes_images = True
    lora_skip = ("visual",)  # LoRA adapts the language model; the tower is frozen or fully trained (vision_trainable)

    def __init__(self, cfg: DecoderConfig, vision: VisionConfig, tokens: ImageTokenIds, *,
                 vision_trainable: bool = False):
        if cfg.mrope_section is None:
            raise ConfigError("VisionLM needs a decoder config with mrope_section (M-RoPE)")
        super().__init__(cfg)
        self.vision_config, self.image_tokens = vision, tokens
        self.visual = VisionTower(vision)
        init_weights(self.visual)
        set_trainable(self.visual, vision_trainable)

    @property
    def image_token_id(self) -> int:
        return self.image_tokens.image_token_id

    def image_tokens_of(self, image) -> int:
        """Placeholder tokens the processor put in the prompt for one row's images (its count checked against the
        tower's: a processor of another merge size is an error)."""
        count = sum(self.vision_config.tokens(g) for g in image.grids)
        made = sum(getattr(image, "tokens", ()) or ())
        if made and made != count:
            raise ValueError(f"the processor counted {made} image tokens for grids {list(image.grids)}, this model's "
                             f"tower merges them into {count}: the processor's merge size differs from the model's")
        return count

    def image_features(self, images: Sequence) -> list[Optional[torch.Tensor]]:
        """The tower's output per row ([M_row, 1 + k, H]: the placeholder embeddings and k deepstack features; None
        for a text row); rows holding the same object share one tower pass (the n samples of a prompt), and every
        distinct image of the call goes through it together."""
        distinct = list({id(im): im for im in images if im is not None}.values())
        if not distinct:
            return [None] * len(images)
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.cat([im.pixel_values for im in distinct]).to(weight.device)  # [N, F]
        features = self.visual(pixels, [g for im in distinct for g in im.grids])    # [M, 1 + k, H]
        parts = features.split([self.image_tokens_of(im) for im in distinct])
        by_id = {id(im): part for im, part in zip(distinct, parts)}
        return [None if im is None else by_id[id(im)] for im in images]

    def image_segments(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """(first placeholder, placeholders) of each image segment of one row's ids (mrope.image_segments)."""
        return image_segments(np.asarray(ids, dtype=np.int64), self.image_tokens)

    def image_spans(self, ids: np.ndarray, image, label: str) -> list[tuple[int, int, int, int, int]]:
        """The spans (first token, tokens, t, rows, columns) of one row's images among its real ids [L]
        (mrope.place_images); a mismatch is a ValueError naming `label` (a row, a prompt)."""
        want = 0 if image is None else self.image_tokens_of(image)
        try:
            return place_images(ids, [] if image is None else list(image.grids), tokens=self.image_tokens,
                                merge=self.vision_config.spatial_merge_size, starts=recorded_starts(image))
        except ValueError as e:
            held = int((ids == self.image_token_id).sum())
            raise ValueError(f"{label} holds {held} image placeholder tokens, its images give {want} "
                             f"(image_grid_thw): {e}") from None

    def check_pixels(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor,
                     images: Optional[Sequence]) -> None:
        """A training batch's rows against their pixels, where the ids' origin is known: input_ids, attention_mask
        [b, S] (prompts left-padded, responses after), loss_mask [b, R] 1 on the tokens the policy sampled (the last
        R columns; observation tokens 0), images per row or None. The image segments of each row's prompt and
        observations must be exactly its images (more: the batch lost pixels on the way, a text forward would never
        see them), at their recorded starts where the images record them; a segment the policy sampled is text.
        Images without recorded starts fill the segments in order, so there a segment the policy sampled before one
        of them would take that image's place and is refused, naming the row."""
        if not bool((input_ids == self.image_token_id).any()):
            return
        ids, real = input_ids.cpu().numpy(), attention_mask.bool().cpu().numpy()  # [b, S]
        written = real.copy()
        R = loss_mask.shape[1]
        written[:, written.shape[1] - R:] &= ~loss_mask.bool().cpu().numpy()  # [b, S] the ids the policy did not sample
        for row in range(ids.shape[0]):
            cols = np.flatnonzero(real[row])
            was = written[row, cols]  # [L]
            segments = self.image_segments(ids[row, cols])
            origin = [bool(was[first - 1:first + n + 1].all()) for first, n in segments]
            held = sum(origin)
            image = None if images is None else images[row]
            want = 0 if image is None else len(image.grids)
            if held != want:
                raise ValueError(f"row {row}: its prompt and observations hold {held} image segment(s) of image "
                                 f"placeholder tokens, its images give {want}: the batch lost the pixels of its "
                                 "images on the way, or its ids and pixels did not come from one processor call")
            starts = recorded_starts(image)
            theirs = [first for (first, _), ok in zip(segments, origin) if ok]  # the prompt's and observations'
            if starts and theirs != list(starts):
                raise ValueError(f"row {row}: its prompt and observations hold image segments at tokens {theirs}, "
                                 f"its images are recorded at {list(starts)}: its ids and pixels did not come from "
                                 "one processor call")
            if held and not starts and not all(origin[:held]):
                raise ValueError(f"row {row}: the policy sampled a whole image segment (<|vision_start|>, "
                                 "placeholders, <|vision_end|>) before one of the row's images, whose place the "
                                 "training forward would give it (images that record no starts fill the segments "
                                 "in order; data.images.ImageInputs.starts)")

    def image_layout(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor], images: Sequence,
                     seq_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(M-RoPE positions [3, B, S], is_image [B, S] bool: the tokens the rows' images fill) of a padded batch
        (each row's real tokens, attention_mask 1, from position 0; padding at 0), or of packed rows (seq_ids [1, N],
        images[k] the k-th packed row's; [3, 1, N] and [1, N]). One host pass over the ids."""
        ids = input_ids.cpu().numpy()  # [B, S]
        B, S = ids.shape
        if seq_ids is None:
            real = np.ones((B, S), bool) if attention_mask is None else attention_mask.bool().cpu().numpy()
            rows = [(b, np.flatnonzero(real[b])) for b in range(B)]  # (batch row, its real columns)
        else:
            ends = np.cumsum(np.bincount(seq_ids[0].cpu().numpy(), minlength=len(images)))
            rows = [(0, np.arange(end - n, end)) for n, end in zip(np.diff(ends, prepend=0), ends)]
        if len(images) != len(rows):
            raise ValueError(f"images has {len(images)} entries for {len(rows)} rows")
        positions = torch.zeros(3, B, S, dtype=torch.long)
        is_image = np.zeros((B, S), bool)
        for row, ((b, cols), image) in enumerate(zip(rows, images)):
            spans = self.image_spans(ids[b, cols], image, f"row {row}")
            positions[:, b, torch.from_numpy(cols)] = span_positions(len(cols), spans)[0]
            for first, n, *_ in spans:
                is_image[b, cols[first:first + n]] = True
        device = input_ids.device
        return positions.to(device), torch.from_numpy(is_image).to(device)

    def embed_with_images(self, input_ids: torch.Tensor, images: Sequence, seq_ids: Optional[torch.Tensor] = None,
                          is_image: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """input_ids [B, S] -> (embeddings [B, S, H] with the placeholder tokens the rows' images fill replaced by
        their features, the deepstack features of those tokens in order [n, k, H] or None). is_image [B, S]: those
        tokens (image_layout, which checks them; computed here when not given, every token real). seq_ids [1, N]:
        packed rows (images[k] is the k-th packed row's)."""
        if is_image is None:
            is_image = self.image_layout(input_ids, None, images, seq_ids)[1]
        h = embed(input_ids, self.model.embed_tokens.weight, self.config.embed_scale)  # [B, S, H]
        features = [f for f in self.image_features(images) if f is not None]
        if not features:
            return h, None
        features = torch.cat(features).to(h.dtype)  # [n, 1 + k, H]
        deepstack = features[:, 1:] if features.shape[1] > 1 else None
        return h.masked_scatter(is_image[..., None], features[:, 0]), deepstack

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, kv_cache=None, *, images: Optional[Sequence] = None,
                seq_ids=None, boundaries=None, routing=None) -> torch.Tensor:
        """input_ids [B, S] -> hidden [B, S, H]. images: per row None or its ImageInputs (None: a text batch, plain
        positions as given, every marker id text). With images, the positions are the rows' M-RoPE positions
        (position_ids is ignored); packed rows (seq_ids [1, N], images[k] the k-th row's) too. A KV cache takes no
        images (the engine prefills them itself: prefill_inputs)."""
        if images is None or all(im is None for im in images):  # lost pixels: check_pixels, where origins are known
            return super().forward(input_ids, position_ids, attention_mask, kv_cache, seq_ids=seq_ids,
                                   boundaries=boundaries, routing=routing)
        if kv_cache is not None:
            raise ValueError("VisionLM.forward(images=...) takes no KV cache; the rollout engine prefills images "
                             "itself (prefill_inputs)")
        positions, is_image = self.image_layout(input_ids, attention_mask, images, seq_ids)
        embeds, deepstack = self.embed_with_images(input_ids, images, seq_ids, is_image)
        after = None if deepstack is None else deepstack_adder(is_image, deepstack)
        return self.model(input_ids, positions, attention_mask, seq_ids=seq_ids, boundaries=boundaries, embeds=embeds,
                          after_layer=after)

    @torch.no_grad()
    def prefill_inputs(self, prompts: Sequence[Sequence[int]], images: Sequence) -> list:
        """For the rollout engine: per prompt with an image, (embeddings [L, H] with the image features in place
        (placed as the training forward places them: at the images' recorded starts, an index into the prompt, else
        on its segments in order; every other marker is text),
        M-RoPE positions [3, L], delta: decode positions are slot position + delta, the deepstack additions [k, L, H]
        or None); None for a text prompt. The distinct images of the call go through the tower together, once
        each."""
        features = {id(im): f for im, f in zip(images, self.image_features(images))}  # shared by identity
        out = []
        for prompt, image in zip(prompts, images):
            if image is None:
                out.append(None)
                continue
            host = np.asarray(prompt, dtype=np.int64)
            spans = self.image_spans(host, image, "a prompt")  # the same placement as the training forward's
            ids = torch.from_numpy(host).to(self.output_weight.device)
            embeds = embed(ids, self.model.embed_tokens.weight, self.config.embed_scale)  # [L, H]
            is_image = torch.zeros(len(host), dtype=torch.bool)
            for first, n, *_ in spans:
                is_image[first:first + n] = True
            is_image = is_image.to(ids.device)
            feats = features[id(image)].to(embeds.dtype)  # [n, 1 + k, H]
            embeds = embeds.masked_scatter(is_image[:, None], feats[:, 0])
            deepstack = None
            if feats.shape[1] > 1:  # [k, L, H]: the features at the image tokens, zero elsewhere
                deepstack = torch.zeros(feats.shape[1] - 1, *embeds.shape, dtype=embeds.dtype, device=embeds.device)
                deepstack[:, is_image] = feats[:, 1:].transpose(0, 1)
            positions, delta = span_positions(len(host), spans)
            out.append((embeds, positions.to(ids.device), delta, deepstack))
        return out


def recorded_starts(image) -> tuple:
    """The first placeholder of each of a row's images, as recorded with its ids (data.images.ImageInputs.starts; its
    real ids from the first); () for a text row or images that record none (placed in order)."""
    return tuple(getattr(image, "starts", ()) or ()) if image is not None else ()


def deepstack_adder(is_image: torch.Tensor, deepstack: torch.Tensor):
    """Qwen3-VL's after_layer for DecoderModel.forward: after layer i < k, the i-th deepstack features are added to
    the hidden states of the image tokens. is_image [B, S] bool, deepstack [n, k, H] (the image tokens in order)."""
    where = is_image.nonzero(as_tuple=True)  # ([n], [n])

    def add(i: int, h: torch.Tensor) -> torch.Tensor:
        if i >= deepstack.shape[1]:
            return h
        return h.index_put(where, deepstack[:, i].to(h.dtype), accumulate=True)
    return add


def set_vision_trainable(model, trainable: bool) -> None:
    """model.vision_trainable: train the tower and its merger too (a vision-language model; they start frozen); a
    warning for a text model, where the setting means nothing."""
    if getattr(model, "takes_images", False):
        set_trainable(model.visual, trainable)
    elif trainable:
        log.warning("model.vision_trainable=true is ignored: %s is a text model", type(model).__name__)


def is_vl_config(hf_config: dict) -> bool:
    return hf_config.get("model_type") in VL_MODEL_TYPES


def build_vl(hf_config: dict, source: str, *, vision_trainable: bool = False, meta: bool = False) -> VisionLM:
    cfg, vision, tokens = vl_config_from_hf(hf_config, source=source)
    if meta:
        with torch.device("meta"):
            return VisionLM(cfg, vision, tokens, vision_trainable=vision_trainable)
    return VisionLM(cfg, vision, tokens, vision_trainable=vision_trainable)


def write_config(directory: Path, model: VisionLM, dtype: str) -> None:
    config = vl_config_to_hf(model.config, model.vision_config, model.image_tokens, dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
