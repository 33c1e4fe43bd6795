"""Rollout ranks that train: the engine refresh after an in-flight weight update, and GRPO runs of 2 and 3 gloo
processes (trainer ranks + one rollout rank) that train, keep the staleness bound, hold the trainer's weights after
every sync and stop with one line when the rollout rank dies (docs/distributed.md, "Rollout ranks").

The multi-process cases fork their ranks (tests/_multiproc.py) and each rank saves what the test checks.
"""
import json
import os
import signal
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from _multiproc import free_port, start_method

from phaserl.models.lora import LoRASettings, apply_lora
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.test_rollout_engine import PROMPTS, tiny_model

torch.set_num_threads(1)


def _sample_in_session(engine, params, *, swap_after: int = 0, new_model=None) -> dict:
    """Each of PROMPTS run to its end in one session; after `swap_after` steps the engine's model takes
    `new_model`'s weights in place and the engine is refreshed; sequences started after that see only them."""
    got, step = {}, 0
    waiting = list(range(len(PROMPTS)))
    with engine.session(params, slot_len=40, eos_token_ids=[], generator=torch.Generator().manual_seed(5)) as s:
        while waiting or not s.idle:
            if new_model is not None and step == swap_after:
                with torch.no_grad():
                    for p, q in zip(engine.model.parameters(), new_model.parameters()):
                        p.copy_(q)
                engine.refresh_weights()
            while waiting and s.free_slots and step >= swap_after:
                key = waiting.pop(0)
                s.start(key, PROMPTS[key], params.max_new_tokens, noise_key=key)
            for turn in s.step():
                got[turn.key] = (turn.token_ids, turn.logprobs)
                s.release(turn.key)
            step += 1
    return got


@pytest.mark.parametrize("lora", [False, True])
def test_a_refreshed_engine_samples_what_a_freshly_built_one_does(lora):
    """Weights copied into the model in the middle of a session, then refresh_weights(): every sequence started after
    it samples the tokens and log-probs an engine built on the new weights does (the fused [q;k;v], [gate;up] and
    LoRA-merged copies refilled); without the refresh it does not."""
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    if lora:
        for m, seed in ((old, 2), (new, 3)):
            apply_lora(m, LoRASettings(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")))
            with torch.no_grad():
                g = torch.Generator().manual_seed(seed)
                for name, p in m.named_parameters():
                    if "lora" in name:
                        p.copy_(0.3 * torch.randn(p.shape, generator=g))
    expected = _sample_in_session(RolloutEngine(new, EngineConfig(max_slots=4)), params)
    engine = RolloutEngine(old, EngineConfig(max_slots=4))
    got = _sample_in_session(engine, params, swap_after=2, new_model=new)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key][0] == expected[key][0]
        torch.testing.assert_close(torch.tensor(got[key][1]), torch.tensor(expected[key][1]))

    if not lora:  # the bug this guards against: parameters swapped, the fused copies kept
        stale = RolloutEngine(tiny_model(seed=0), EngineConfig(max_slots=4))
        stale.refresh_weights = lambda: None
        assert _sample_in_session(stale, params, swap_after=2, new_model=tiny_model(seed=1)) != expected
