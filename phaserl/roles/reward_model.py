"""RewardModelWrapper: score (prompt, response) pairs with a frozen sequence-classification reward model.

The wrapper owns the reward model's input format, classic mistake 2: it turns each prompt and
response *text* into the exact string the RM was trained on (its own chat template, a custom one, or
plain `prompt + response`), tokenizes it with the RM's own tokenizer (never the policy's token ids),
truncates on the configured side, and checks the output: one finite float per response.
`probe` scores one batch before training and says why when the scores look wrong.

Formatting: with `apply_chat_template`, messages = the prompt's messages (a string prompt becomes one
user message) + {"role": "assistant", "content": response}, rendered by `chat_template` or else the
tokenizer's template, then tokenized without adding special tokens (templates carry their own).
Without it the text is prompt + response with no separator (chat-message prompts: contents joined by
"\n"), tokenized with the tokenizer's special tokens (e.g. BOS); if your RM wants a separator, write a
`chat_template` that puts it there. Scores come back on the CPU as float32.

Two engines, one pooling rule (the score at the last non-pad token, transformers' `*ForSequenceClassification`
rule), so the scores do not depend on the engine, the tokenizer's padding_side or which rows share a batch:
- phaserl: the RM is phaserl's `ValueModel` (`from_pretrained` picks it for llama / qwen2 / qwen3 classifier
  directories). Micro-batches are formed by a token budget (`micro_batch_tokens`, longest rows first) and,
  with packing, hold the rows' real tokens without padding (roles/reward_scoring.py).
- transformers: any other classifier (or one passed in), `batch_size` rows per forward, right-padded.

Not here: training reward models, mixing RM scores with rule rewards (the trainer's score phase).
Shape legend: B = responses in a call, b = responses in one forward batch, T = longest input in it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from phaserl.errors import ConfigError, RewardError
from phaserl.models import ValueModel, load_tokenizer
from phaserl.models.decoder import use_varlen
from phaserl.parallel import is_distributed, max_over_ranks, reshard_params

from .parallel_settings import FSDPSettings
from .reward_scoring import ENGINES, load_native, native_support, right_pad, score_packed, score_padded, token_groups

logger = logging.getLogger(__name__)
_FORMAT_HINT = ("the input format probably does not match what the reward model was trained on: check "
                "apply_chat_template / chat_template, response_key, and that the tokenizer is the RM's own")


@dataclass
class ProbeReport:
    ok: bool
    reason: str            # empty when ok; otherwise the likely cause and the fix
    scores: list[float]    # [B] what the RM gave the probe batch (empty when scoring failed)
    example_input: str     # the exact text the RM saw for the first probe row ("" if formatting failed)
    truncated: int         # probe inputs whose response end was cut by right truncation


class RewardModelWrapper:
    """A frozen reward model plus the input format it expects; `score` returns one float per response."""

    def __init__(self, model, tokenizer=None, *, apply_chat_template: bool = True, chat_template: str | None = None,
                 response_key: str = "response", max_length: int = 512, truncation: bool = True,
                 truncation_side: str = "left", batch_size: int = 16, micro_batch_tokens: int = 16384,
                 packing: bool | None = None, device=None):
        """`model`: a phaserl ValueModel (phaserl engine: micro-batches of at most `micro_batch_tokens`
        tokens, packed when `packing`, None = where the varlen kernel runs) or a transformers-style
        classifier (`batch_size` rows per forward)."""
        if truncation_side not in ("left", "right"):
            raise ConfigError(f"RewardModelWrapper: truncation_side must be 'left' or 'right', "
                              f"got {truncation_side!r}")
        if max_length < 1 or batch_size < 1 or micro_batch_tokens < 1:
            raise ConfigError(f"RewardModelWrapper: max_length ({max_length}), batch_size ({batch_size}) and "
                              f"micro_batch_tokens ({micro_batch_tokens}) must be >= 1")
        num_labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if num_labels != 1:
            raise RewardError(f"the reward model has num_labels={num_labels}; a reward model outputs one score per "
                              f"sequence (num_labels=1). Load a reward model with "
                              f"AutoModelForSequenceClassification, not a {num_labels}-way classifier "
                              f"(a causal LM's config also says num_labels=2).")
        self.model = model.requires_grad_(False).eval()  # frozen: the RM is never trained here
        if device is not None:
            self.model.to(device)
        first = next(iter(self.model.parameters()), None)
        self.device = torch.device(device) if device is not None else (first.device if first is not None
                                                                       else torch.device("cpu"))
        self.tokenizer = tokenizer if tokenizer is not None else _find_tokenizer(model)
        self.apply_chat_template = apply_chat_template
        self.chat_template = chat_template
        if apply_chat_template and chat_template is None and not self.tokenizer.chat_template:
            raise RewardError("apply_chat_template=True but the reward model's tokenizer has no chat template: pass "
                              "chat_template='...' (the format the RM was trained on) or apply_chat_template=False.")
        self.response_key = response_key
        self.max_length, self.truncation, self.truncation_side = max_length, truncation, truncation_side
        self.engine = "phaserl" if isinstance(model, ValueModel) else "transformers"
        self.batch_size, self.micro_batch_tokens, self.packing = batch_size, micro_batch_tokens, packing
        if packing and self.engine == "transformers":
            logger.info("[RewardModelWrapper] packing=True is ignored: the reward model (%s) is not phaserl's "
                        "decoder, so it scores right-padded batches of batch_size=%d", type(model).__name__,
                        batch_size)
        self.fsdp: FSDPSettings | None = None  # reward_model.fsdp, set by the builder before it shards the RM
        self.pad_id = self._choose_pad_id()
        self.truncated_count = 0       # inputs whose response end was cut (truncation_side="right")
        self.left_truncated_count = 0  # inputs whose prompt start was cut (truncation_side="left")
        if isinstance(model, ValueModel):
            embeddings = model.model.embed_tokens
        else:
            embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.vocab_size = getattr(embeddings, "num_embeddings", None)

    @classmethod
    def from_pretrained(cls, path: str, *, tokenizer_path: str | None = None, dtype: str | torch.dtype | None = None,
                        trust_remote_code: bool = False, engine: str = "auto", device=None,
                        **kwargs) -> "RewardModelWrapper":
        """The reward model of a local directory and its own tokenizer (phaserl's `load_tokenizer`, the one
        `phaserl train-rm` uses); kwargs go to __init__. dtype None keeps the checkpoint's.

        engine: "phaserl" loads a llama / qwen2 / qwen3 `*ForSequenceClassification` directory (num_labels=1)
        as phaserl's ValueModel (packed token-budget micro-batches); "transformers" loads
        AutoModelForSequenceClassification (`batch_size` rows per forward); "auto" takes phaserl's when the
        directory qualifies, transformers' otherwise."""
        if engine not in ENGINES:
            raise ConfigError(f"RewardModelWrapper.from_pretrained: engine={engine!r}; expected one of "
                              f"{', '.join(ENGINES)}")
        for what, where in (("reward model", path), ("reward model tokenizer", tokenizer_path or path)):
            if not os.path.isdir(where):
                raise RewardError(f"{what} directory {where} not found; reward_model.path / tokenizer_path must "
                                  f"be a local Hugging Face directory (config.json, weights, tokenizer files).")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        unsupported = "engine=transformers" if engine == "transformers" else native_support(path)
        if engine == "phaserl" and unsupported:
            raise RewardError(f"reward_model.engine=phaserl but phaserl's decoder cannot run {path}: {unsupported}. "
                              f"Set reward_model.engine=transformers (or auto) to score it with transformers.")
        if unsupported:
            if engine == "auto":
                logger.info("[RewardModelWrapper] scoring %s with transformers (padded batches of batch_size): %s",
                            path, unsupported)
            model = _load_transformers(path, dtype, trust_remote_code)
        else:
            try:
                model = load_native(path, dtype=dtype, device=device if device is not None else "cpu")
            except ConfigError as err:
                raise RewardError(f"reward model {path}: {err}. Fix the directory (reward_model.path), or set "
                                  f"reward_model.engine=transformers to load it with transformers.") from err
        try:
            tokenizer = load_tokenizer(tokenizer_path or path, trust_remote_code=trust_remote_code)
        except ConfigError as err:
            raise RewardError(f"reward model tokenizer: {err}. Set reward_model.tokenizer_path to the RM's own "
                              f"tokenizer directory.") from err
        return cls(model, tokenizer, device=device, **kwargs)

    def format(self, prompt: str | list[dict], response: str) -> str:
        """The exact text the reward model sees for one (prompt, response) pair."""
        if not isinstance(response, str):
            raise RewardError(f"the response to score must be a string, got {type(response).__name__} {response!r:.80}")
        if not self.apply_chat_template:
            return _prompt_text(prompt) + response
        messages = _as_messages(prompt) + [{"role": "assistant", "content": response}]
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False)

    def score_rows(self, rows: list[dict]) -> torch.Tensor:
        """Score rows that carry "prompt" and the response under `response_key`; [B] float32."""
        for i, row in enumerate(rows):
            for key in ("prompt", self.response_key):
                if key not in row:
                    raise RewardError(f"row {i} has no {key!r} field (its fields: {', '.join(map(str, row))}). "
                                      f"Pass response_key=<the field holding the response to score> "
                                      f"(e.g. response_key='chosen_response' for preference rows) and keep "
                                      f"the prompt under 'prompt'.")
        return self.score([row["prompt"] for row in rows], [row[self.response_key] for row in rows])

    def score(self, prompts: list, responses: list[str]) -> torch.Tensor:
        """One finite float32 score per response, on the CPU; [B]."""
        if len(prompts) != len(responses):
            raise ValueError(f"RewardModelWrapper.score: {len(prompts)} prompts but {len(responses)} responses")
        texts = [self.format(p, r) for p, r in zip(prompts, responses)]
        ids = self._encode(texts)
        self._check_tokens(ids, texts)
        packed = self._packs()
        groups = self._micro_batches(ids, packed)
        padding = self._lockstep_padding(len(groups)) if self.sharded else 0  # before any forward: a collective
        scores = torch.zeros(len(ids))  # [B]
        for group in groups:
            scores[torch.tensor(group)] = self._forward([ids[i] for i in group], packed)
        if self.sharded:
            for _ in range(padding):
                self._forward([[self.pad_id]], packed)
            reshard_params(self.model)  # a frozen model has no backward, where FSDP2 would free the root unit
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(f"the reward model produced non-finite scores for rows {bad[:10]} of {len(texts)} "
                              f"(values {scores[bad[:5]].tolist()}). Likely cause: {_FORMAT_HINT}; or a float16 "
                              f"overflow (load the RM in bfloat16/float32). Row {bad[0]} was formatted as "
                              f"{_shorten(texts[bad[0]])}.")
        return scores

    def probe(self, prompts: list, responses: list[str]) -> ProbeReport:
        """Score one batch and judge the scores: finite, shape [B], not constant. Used by `doctor`."""
        before = self.truncated_count
        try:
            example = self.format(prompts[0], responses[0]) if prompts else ""
            scores = self.score(prompts, responses)
        except Exception as exc:  # the report carries any failure to the user instead of a traceback
            return ProbeReport(False, f"{type(exc).__name__}: {exc}", [], "", self.truncated_count - before)
        cut = self.truncated_count - before
        values = scores.tolist()
        reason = ""
        if len(values) >= 2 and scores.std().item() < 1e-6:
            same = " (the probe responses are identical: give it different ones)" if len(set(responses)) == 1 else ""
            reason = (f"the reward model gave the same score {values[0]:.6g} to all {len(values)} responses{same}. "
                      f"Likely cause: {_FORMAT_HINT}; or right truncation cut every response "
                      f"({cut} of {len(values)} cut here: use truncation_side='left' or a larger max_length); "
                      f"or the RM's score head is untrained.")
        return ProbeReport(not reason, reason, values, example, cut)

    def _choose_pad_id(self) -> int:
        config = getattr(self.model, "config", None)
        pad = self.tokenizer.pad_token_id
        if pad is None:
            if self.tokenizer.eos_token_id is None:
                raise RewardError("the reward model's tokenizer has neither a pad nor an eos token; set one "
                                  "(tokenizer.pad_token = ...) before building RewardModelWrapper.")
            pad = self.tokenizer.eos_token_id
            logger.info("[RewardModelWrapper] the RM tokenizer has no pad token; padding with its eos token "
                        "%r (id %d)", self.tokenizer.eos_token, pad)
        config_pad = getattr(config, "pad_token_id", None)
        if config is not None and config_pad is None:
            # transformers' classifiers find each row's last token through config.pad_token_id.
            config.pad_token_id = pad
            logger.info("[RewardModelWrapper] set the reward model's config.pad_token_id to %d", pad)
        elif config_pad is not None and config_pad != pad:
            logger.info("[RewardModelWrapper] padding with the model's config.pad_token_id %d (the tokenizer says "
                        "%d) so the model's last-token pooling finds each response's end", config_pad, pad)
            pad = config_pad
        return pad

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids per text, truncated to max_length on the configured side."""
        encoded = self.tokenizer(texts, add_special_tokens=not self.apply_chat_template)["input_ids"] if texts else []
        out, cut_now = [], 0
        for i, ids in enumerate(encoded):
            if len(ids) <= self.max_length:
                out.append(list(ids))
            elif not self.truncation:
                raise RewardError(f"reward model input for row {i} is {len(ids)} tokens, over max_length="
                                  f"{self.max_length}, and truncation is off: raise reward_model.max_length or set "
                                  f"reward_model.truncation=true (truncation_side='left' keeps the response end).")
            elif self.truncation_side == "left":
                out.append(list(ids[-self.max_length:]))
                self.left_truncated_count += 1
            else:
                out.append(list(ids[:self.max_length]))
                cut_now += 1
        if cut_now:
            self.truncated_count += cut_now
            logger.warning("[RewardModelWrapper] %d of %d inputs were over max_length=%d and truncation_side='right' "
                           "cut their response end (%d so far): the RM does not see how those responses end; use "
                           "truncation_side='left' or a larger max_length", cut_now, len(texts), self.max_length,
                           self.truncated_count)
        return out

    def _check_tokens(self, ids: list[list[int]], texts: list[str]) -> None:
        """Every input has tokens, all inside the RM's vocabulary (checked before any forward)."""
        empty = [i for i, row in enumerate(ids) if not row]
        if empty:
            raise RewardError(f"reward model inputs for rows {empty[:10]} have no tokens at all (row {empty[0]} was "
                              f"formatted as {_shorten(texts[empty[0]])}): there is nothing to score. Use "
                              f"apply_chat_template / chat_template, or make sure prompts and responses are not empty.")
        top = max((max(row) for row in ids), default=0)
        if self.vocab_size is not None and top >= self.vocab_size:
            raise RewardError(f"token id {top} is outside the reward model's vocabulary ({self.vocab_size} ids): the "
                              f"tokenizer is not the RM's own. Pass the RM's tokenizer (reward_model.tokenizer_path).")

    def _packs(self) -> bool:
        """Pack the phaserl engine's micro-batches? `packing`, or where the varlen kernel runs (ppo.packing's
        rule: CUDA with bf16/fp16 compute, FSDP's param_dtype when sharded; the CPU's dense block mask costs
        more than the padding it saves)."""
        if self.engine != "phaserl":
            return False
        if self.packing is not None:
            return self.packing
        dtype = next(self.model.parameters()).dtype
        if self.sharded and self.fsdp is not None and self.fsdp.param_dtype is not None:
            dtype = getattr(torch, self.fsdp.param_dtype)
        return use_varlen(self.device, dtype)

    def _micro_batches(self, ids: list[list[int]], packed: bool) -> list[list[int]]:
        """Row indices per forward: by token budget on the phaserl engine, `batch_size` rows in order otherwise."""
        if self.engine == "phaserl":
            return token_groups([len(row) for row in ids], self.micro_batch_tokens, packed=packed)
        return [list(range(s, min(s + self.batch_size, len(ids)))) for s in range(0, len(ids), self.batch_size)]

    @property
    def sharded(self) -> bool:
        """True once FSDP2 split the model over the ranks (reward_model.fsdp, applied by the builder)."""
        return is_distributed() and any(hasattr(p, "placements") for p in self.model.parameters())

    @staticmethod
    def _lockstep_padding(batches: int) -> int:
        """A sharded forward is a collective: every rank runs as many batches as the busiest rank.

        Ranks can hold different numbers of responses (validation prompts split unevenly); a rank with
        fewer runs this many one-token batches after its own."""
        return max_over_ranks(batches) - batches

    def _forward(self, batch: list[list[int]], packed: bool) -> torch.Tensor:
        """Run the RM on one micro-batch (packed, or right-padded), return its scores as CPU float32; [b]."""
        if self.engine == "phaserl":
            score = score_packed if packed else score_padded
            with torch.inference_mode():
                logits = score(self.model, batch, self.pad_id, self.device)  # [b]
            return logits.detach().to(device="cpu", dtype=torch.float32).clone()
        input_ids, attention_mask = right_pad(batch, self.pad_id)  # [b, T] each
        with torch.inference_mode():
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device))
        logits = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
        if not isinstance(logits, torch.Tensor):
            raise RewardError(f"the reward model returned {type(out).__name__}; it must return logits [B] or [B, 1] "
                              f"(a tensor, or an output with .logits)")
        if logits.dim() == 2 and logits.shape[1] == 1:
            logits = logits[:, 0]
        if tuple(logits.shape) != (len(batch),):
            raise RewardError(f"the reward model returned logits of shape {list(logits.shape)} for a batch of "
                              f"{len(batch)}; expected [{len(batch)}] or [{len(batch)}, 1]. A reward model is a "
                              f"sequence classifier with num_labels=1, not a causal LM or a multi-label head.")
        # A copy made outside inference mode is an ordinary tensor the trainer may use freely.
        return logits.detach().to(device="cpu", dtype=torch.float32).clone()  # [b]


def _load_transformers(path: str, dtype: torch.dtype | None, trust_remote_code: bool):
    """transformers' AutoModelForSequenceClassification from a local directory (the transformers engine)."""
    from transformers import AutoModelForSequenceClassification

    model_kwargs = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        model_kwargs["dtype"] = dtype
    return AutoModelForSequenceClassification.from_pretrained(path, **model_kwargs)


def _find_tokenizer(model):
    """The RM's own tokenizer when the caller did not pass one: model.tokenizer or its from_pretrained dir."""
    if getattr(model, "tokenizer", None) is not None:
        return model.tokenizer
    path = getattr(model, "name_or_path", "")
    if isinstance(path, str) and os.path.isdir(path):
        logger.info("[RewardModelWrapper] using the tokenizer saved with the reward model in %s", path)
        return load_tokenizer(path)
    raise RewardError("RewardModelWrapper needs the reward model's own tokenizer: pass tokenizer="
                      "AutoTokenizer.from_pretrained(<RM dir>), or build it with "
                      "RewardModelWrapper.from_pretrained(<RM dir>).")


def _as_messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in prompt):
        return [dict(m) for m in prompt]
    raise RewardError(f"a prompt must be a string or a list of {{'role', 'content'}} messages, got "
                      f"{type(prompt).__name__} {_shorten(repr(prompt))}")


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(str(m["content"]) for m in _as_messages(prompt))


def _shorten(text: str, limit: int = 160) -> str:
    return repr(text) if len(text) <= limit else f"{text[:60]!r} ... {text[-90:]!r} ({len(text)} chars)"
