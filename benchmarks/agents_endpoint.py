"""Throughput through the OpenAI-compatible endpoint vs the rollout engine called directly.

One JSON line per measurement on stdout. Shape (BRIEF §6's reference): Qwen2-0.5B architecture with
random weights, bf16, 64 rows x 8 samples = 512 conversations, prompt 128 tokens, 256 new tokens per
completion (no EOS: fixed lengths). Cases, all in one process on one engine:

    direct          engine.generate on the 512 prompts at once (the single-turn number)
    endpoint_1turn  512 harness threads, each one chat completion (HTTP, stdlib client) through ChatServer
    endpoint_2turn  the same harnesses, each asking a second time after a 16-token user turn

`ratio_vs_direct` = endpoint tokens/s over direct tokens/s. The endpoint pays for HTTP, chat-template
rendering, tokenizing, and gathering concurrent requests into batches (GenerateBackend); the second
turn's requests arrive as the first turn's finish, so it also measures re-batching.

    python benchmarks/agents_endpoint.py              # the H200 shape
    python benchmarks/agents_endpoint.py --smoke      # CPU, tiny shape: checks the script
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from phaserl.agents.completion import GenerateBackend  # noqa: E402
from phaserl.agents.harness import run_harness  # noqa: E402
from phaserl.agents.server import ChatServer  # noqa: E402
from phaserl.models import CausalLM  # noqa: E402
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402
from qwen2_shapes import decoder_config  # noqa: E402


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def id_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token i is the text "<ti>": any sampled id decodes and re-encodes to itself (random weights sample anything).
    The special tokens sit above the model's vocabulary, so no sampled id is dropped from a reply's text."""
    vocab = {f"<t{i}>": i for i in range(vocab_size)} | {"<pad>": vocab_size, "<eos>": vocab_size + 1}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"<t\d+>"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(["<pad>", "<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<pad>", pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    return tok


def post_json(url: str, body: dict) -> dict:
    """The harness's HTTP call, with the stdlib (the device machine has no openai package)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def text_of(ids: list) -> str:
    return "".join(f"<t{i}>" for i in ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--gather-ms", type=float, default=5.0, help="GenerateBackend.gather_s, in ms")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, 4 x 2 conversations, 16 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.rows, args.samples, args.prompt_len, args.new_tokens = "tiny", 4, 2, 16, 16
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.device(device):
        model = CausalLM(decoder_config(args.shape)).to(dtype).eval()
    vocab = model.output_weight.shape[0]
    tok = id_tokenizer(vocab)
    engine = RolloutEngine(model, EngineConfig(max_slots=args.rows * args.samples))
    g = torch.Generator().manual_seed(0)
    rows = [{"ids": torch.randint(2, min(vocab, 4000), (args.prompt_len,), generator=g).tolist()}
            for _ in range(args.rows)]
    n = args.rows * args.samples
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    prompts = [r["ids"] for r in rows for _ in range(args.samples)]

    def direct():  # on a worker thread, like the endpoint's generate calls: both under the same conditions
        out = []
        worker = threading.Thread(target=lambda: out.append(
            engine.generate(prompts, params, eos_token_ids=[], pad_token_id=0, batch_size=n)))
        worker.start()
        worker.join()
        return out[0]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    direct()  # warm-up: pool, graphs
    sync()
    start = time.perf_counter()
    result = direct()
    sync()
    direct_s = time.perf_counter() - start
    tokens = sum(map(len, result.response_ids))
    emit(case="direct", shape=args.shape, device=device, sequences=n, new_tokens=tokens, seconds=direct_s,
         tokens_per_s=tokens / direct_s)

    def harness(turns):
        def run(base_url, row):
            messages = [{"role": "user", "content": text_of(row["ids"])}]
            for turn in range(turns):
                reply = post_json(base_url + "/chat/completions",
                                  {"model": "bench", "messages": messages, "max_tokens": args.new_tokens})
                messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                             {"role": "user", "content": text_of(row["ids"][:16])}]
            return 0.0
        return run

    # No EOS ids: fixed lengths like the direct case.
    backend = GenerateBackend(engine, eos_token_ids=[], pad_token_id=0, max_batch=n, gather_s=args.gather_ms / 1e3)
    with ChatServer(backend, tok, default_max_tokens=args.new_tokens) as server:
        run_harness(harness(1), rows, server, samples_per_row=args.samples, max_workers=n)  # warm-up
        for turns in (1, 2):
            calls_before = backend.calls
            start = time.perf_counter()
            episodes = run_harness(harness(turns), rows, server, samples_per_row=args.samples, max_workers=n)
            seconds = time.perf_counter() - start
            tokens = sum(sum(len(s.token_ids) for s in e.segments if s.kind == "model") for e in episodes)
            emit(case=f"endpoint_{turns}turn", shape=args.shape, device=device, conversations=n, turns=turns,
                 new_tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds,
                 ratio_vs_direct=(tokens / seconds) / (n * args.new_tokens / direct_s),
                 generate_calls=backend.calls - calls_before, episodes=len(episodes),
                 prefix_mismatches=sum(e.metrics["prefix_mismatches"] for e in episodes) / max(1, len(episodes)),
                 gather_ms=args.gather_ms)


if __name__ == "__main__":
    main()
