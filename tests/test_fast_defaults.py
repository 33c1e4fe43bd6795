"""Fast by default: the auto speed settings' rules, the builder's choices and the start-of-run block,
`--explain`'s rules; and the warm start: torch.compile's caches in phaserl's cache directory, safe when that
directory is unwritable or corrupt, and a second process that compiles from the first one's cache."""
import json
import logging
import os
import subprocess
import sys

import pytest

from _tiny_run import make_run_dir
from phaserl import compile_cache
from phaserl.config import explain, load_config
from phaserl.config.auto import (
    AUTO_RULES,
    COMPILE_MIN_PARAMS,
    KEEP_AWAKE_SHARE,
    LORA_KEEP_SHARE,
    MICRO_ACTIVATION_SHARE,
    MICRO_BATCH_CAP,
    choose,
    compile_rule,
    keep_awake_rule,
    keep_logits_rule,
    micro_batch_rule,
)
from phaserl.errors import ConfigError
from phaserl.memory.budget import ModelShape, kept_engine_bytes, update_peak_bytes

GIB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----- the rules ---------------------------------------------------------------------------------------------
def _compile(**kw):
    facts = dict(native=True, device_type="cuda", triton=True, num_params=494_000_000, world_size=1,
                 model_name="CausalLM")
    return compile_rule(**{**facts, **kw})


def test_compile_is_on_only_for_our_decoder_on_one_cuda_gpu_with_triton_and_a_real_model():
    assert _compile() == (True, "CUDA, phaserl's decoder, Triton")
    assert _compile(device_type="cpu")[0] is False and "CPU" in _compile(device_type="cpu")[1]
    assert _compile(triton=False) == (False, "Triton is not installed")
    assert (_compile(native=False, model_name="Qwen2ForCausalLM")[1]
            == "the model (Qwen2ForCausalLM) is not phaserl's decoder")
    small = _compile(num_params=COMPILE_MIN_PARAMS - 1)
    assert small[0] is False and "small model" in small[1]
    assert _compile(world_size=2)[0] is False and "2 ranks" in _compile(world_size=2)[1]


def _keep(**kw):
    facts = dict(engine_runs=True, device_type="cuda", world_size=1, actor_sharded=True,
                 needed_bytes=21 * GIB, budget_bytes=139 * GIB)
    return keep_awake_rule(**{**facts, **kw})


def test_keep_awake_is_on_when_the_count_fits_with_margin_and_off_under_fsdp_cpu_or_tight_memory():
    assert _keep() == (True, "21.0 GiB needed of 139 GiB")
    edge = int(KEEP_AWAKE_SHARE * 139 * GIB)
    assert _keep(needed_bytes=edge)[0] and not _keep(needed_bytes=edge + 1)[0]
    tight = _keep(needed_bytes=120 * GIB)
    assert tight == (False, "120.0 GiB needed of 139 GiB (more than 75%: tight memory)")
    assert _keep(world_size=2)[0] is False and "FSDP" in _keep(world_size=2)[1]
    assert _keep(world_size=2, actor_sharded=False)[0]  # replicas (NO_SHARD): the memory decides
    assert _keep(device_type="cpu")[0] is False
    assert _keep(engine_runs=False)[0] is False


def test_a_lora_run_keeps_the_engine_only_while_it_is_a_small_share_of_the_peak():
    # H200 runs: 7B r16 kept the engine (~20 of 61.5 GiB counted) and peaked at 58.7 GiB, above TRL + PEFT's
    # 54.3 (asleep by this rule: 41.3 GiB, 0.19 s slower); 0.5B r64 kept ~3 of ~17 GiB and stayed below TRL + PEFT
    on, why = _keep(lora=True, needed_bytes=int(61.5 * GIB), kept_bytes=20 * GIB)
    assert on is False and why == ("LoRA: the kept engine (20.0 GiB: its merged weight copies and KV cache) would be "
                                   "more than 25% of the update's peak (61.5 GiB)")
    assert _keep(lora=True, needed_bytes=17 * GIB, kept_bytes=3 * GIB) == (True, "17.0 GiB needed of 139 GiB")
    edge = int(LORA_KEEP_SHARE * 40 * GIB)
    assert _keep(lora=True, needed_bytes=40 * GIB, kept_bytes=edge)[0]
    assert not _keep(lora=True, needed_bytes=40 * GIB, kept_bytes=edge + 1)[0]
    assert _keep(lora=False, needed_bytes=int(61.5 * GIB), kept_bytes=20 * GIB)[0]  # full fine-tunes: memory decides
    assert _keep(lora=True, device_type="cpu", kept_bytes=20 * GIB)[1] == "CPU (no CUDA graphs to keep)"


def test_an_explicit_value_wins_over_the_rule_and_says_so():
    assert choose("actor.compile", None, (True, "why")).line() == "actor.compile=auto -> on: why"
    assert choose("actor.compile", False, (True, "why")).line() == "actor.compile=false -> off: set in the config"
    assert choose("rollout.engine_keep_awake", True, (False, "x")).value is True


def test_the_memory_count_behind_keep_awake_by_hand():
    shape = ModelShape(num_params=1000, num_layers=2, hidden_size=8, intermediate_size=16, num_kv_heads=2,
                       head_dim=4, vocab_size=50, param_bytes=2)
    # KV per sequence of 10 tokens: 2 x 2 layers x 2 heads x 4 x 2 B x 10 = 640 B; 3 slots + the weights once more
    assert kept_engine_bytes(shape, 3, 10) == 3 * 640 + 2000
    # activations per token: 2 layers x (8*8 + 4*16 + 2*2*4) x 2 B = 576 B; 20 tokens; log-prob chunk 3 x 20 x 50 x 4
    assert update_peak_bytes(shape, resident=100, grads=10, micro_batch_tokens=20,
                             gradient_checkpointing=False) == 100 + 10 + 20 * 576 + 3 * 20 * 50 * 4


@pytest.fixture
def fresh_cache(monkeypatch):
    """No cache chosen yet in this process, no TORCHINDUCTOR_CACHE_DIR (restored afterwards)."""
    monkeypatch.setattr(compile_cache, "_ACTIVE", None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    yield
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


# ----- the config and the run ---------------------------------------------------------------------------------
def test_auto_is_a_spelling_of_null_for_on_off_settings(tmp_path):
    cfg = load_config(None, ["actor.compile=auto", "rollout.engine_keep_awake=true"])
    assert cfg.actor.compile is None and cfg.rollout.engine_keep_awake is True and cfg.critic.compile is None
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  engine_keep_awake: auto\n")
    assert load_config(str(path)).rollout.engine_keep_awake is None
    with pytest.raises(ConfigError, match=r"actor.compile = 'maybe': expected true, false, or auto \(null\)"):
        load_config(None, ["actor.compile=maybe"])


MIB = 2**20


def _micro(fixed_gib: float, per_token_mib: float, seq: int, mini: int = 512, budget_gib: float = 139, device="cuda"):
    """micro_batch_rule on a count that grows linearly: fixed + tokens x per_token."""
    fixed = int(fixed_gib * GIB)
    return micro_batch_rule(device_type=device, sequence_tokens=seq, mini_batch_sequences=mini, fixed_bytes=fixed,
                            budget_bytes=int(budget_gib * GIB), peak_of=lambda t: fixed + int(t * per_token_mib * MIB))


def test_auto_micro_batch_off_cuda_is_the_old_fixed_default_or_one_whole_sequence():
    assert _micro(1, 1, 384, device="cpu") == (16384, "CPU (the fixed default off CUDA)")
    assert _micro(1, 1, 20_000, device="cpu")[0] == 20_000  # a sequence is never split


def test_auto_micro_batch_on_cuda_deals_the_mini_batch_into_the_fewest_micro_batches_the_cap_allows():
    # 0.5B-like: 8 GiB fixed, ~1 MiB per token; room = 8 + 0.4 x (139 - 8) = 60.4 GiB. The mini-batch is
    # 512 x 384 = 196,608 tokens: ceil(196,608 / 32,768) = 6 micro-batches of ceil(512 / 6) = 86 sequences
    # (33,024 tokens, peak 8 + 32.25 GiB), not 85-sequence ones (32,640 tokens), which make 7 with a last one of 2
    tokens, why = _micro(8, 1, 384)
    assert tokens == 86 * 384 == 33_024 and tokens - MICRO_BATCH_CAP < 384
    assert why == ("86 sequence(s) of 384 tokens (6 micro-batch(es) of the 512-sequence mini-batch), update peak "
                   f"40.2 GiB of 139 GiB (the {MICRO_BATCH_CAP}-token cap)")
    assert _micro(8, 1, 384, mini=4) == (4 * 384, "4 sequence(s) of 384 tokens (1 micro-batch(es) of the 4-sequence "
                                                  "mini-batch), update peak 9.5 GiB of 139 GiB (the mini-batch)")


def test_auto_micro_batch_bound_by_memory_is_dealt_evenly_too():
    # 1.5B-like: 20 GiB fixed, 2.2 MiB per token, sequences of 1,280: room = 20 + 0.4 x 119 = 67.6 GiB holds 17
    # sequences (17 x 2.75 = 46.75 GiB of activations; 18 would be 49.5); 256 sequences then take 16 micro-batches,
    # and 16 of 16 sequences are as many micro-batches as 15 of 17 and one of 1, with less memory
    tokens, why = _micro(20, 2.2, 1280, mini=256)
    assert tokens == 16 * 1280
    assert why.startswith("16 sequence(s) of 1280 tokens (16 micro-batch(es) of the 256-sequence mini-batch)")
    assert not why.endswith(")")  # neither the cap nor the mini-batch bound it: memory did


def test_auto_micro_batch_gives_the_activations_their_share_of_what_the_fixed_state_leaves():
    # 7B-like full fine-tune: 59 GiB fixed, 8 MiB per token, sequences of 512: room = 59 + 0.4 x 80 = 91 GiB;
    # 8 sequences = 4,096 tokens x 8 MiB = 32 GiB -> exactly 91; 9 would be 95
    assert MICRO_ACTIVATION_SHARE == 0.4
    assert _micro(59, 8, 512) == (8 * 512, "8 sequence(s) of 512 tokens (64 micro-batch(es) of the 512-sequence "
                                           "mini-batch), update peak 91.0 GiB of 139 GiB")
    # nothing fits: one sequence anyway (a sequence is never split), and the reason says so
    tokens, why = _micro(138, 6.5, 768)
    assert tokens == 768 and why.endswith("(tight memory: one sequence does not leave the activations their share)")


def _keep_logits(peak_gib, logits_gib, fixed_gib=8, **facts):
    facts = {**dict(device_type="cuda", triton=True, compiled=True, plain_head=True), **facts}
    return keep_logits_rule(peak_bytes=int(peak_gib * GIB), logits_bytes=int(logits_gib * GIB),
                            fixed_bytes=int(fixed_gib * GIB), budget_bytes=139 * GIB, **facts)


def test_the_head_keeps_its_logits_where_the_triton_kernels_run_and_the_room_the_micro_batch_left_holds_them():
    # 0.5B-like: room = 8 + 0.4 x (139 - 8) = 60.4 GiB; the update peaks at 40.2 GiB with 33,024-token micro-batches,
    # whose 86 x 256 response tokens keep 22,016 x 151,936 x 2 B = 6.2 GiB of logits
    assert _keep_logits(40.2, 6.2) == (True, "6.2 GiB of kept logits, update peak 46.4 GiB of 139 GiB")
    keep, why = _keep_logits(58, 6.2)  # memory-bound (the 1.5B shape's case): the micro-batch keeps the room
    assert not keep and why.endswith("more than the room the micro-batch leaves (recomputed in backward)")
    assert _keep_logits(1, 1, device_type="cpu") == (False, "CPU: no Triton log-prob kernels")
    assert _keep_logits(1, 1, triton=False) == (False, "Triton is not installed")
    assert _keep_logits(1, 1, compiled=False) == (False, "the actor is not compiled (its log-probs take the unfused "
                                                         "head)")
    assert _keep_logits(1, 1, plain_head=False)[1] == "the actor is not phaserl's decoder with a plain LM head"


def test_keeping_head_logits_where_the_kernels_do_not_run_warns_that_the_setting_is_ignored(tmp_path, caplog):
    from phaserl.trainer import RLTrainer

    with caplog.at_level(logging.WARNING, logger="phaserl"):
        trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + [
            "trainer.loggers=[]", "ppo.keep_head_logits=true"]))
    assert "ppo.keep_head_logits=true is ignored: CPU: no Triton log-prob kernels" in caplog.text
    trainer.train_step()  # the head recomputes its logits, as without the setting
    auto = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path / "auto")) + ["trainer.loggers=[]"]))
    assert auto.run.speed.keep_head_logits.line() == "ppo.keep_head_logits=auto -> off: CPU: no Triton log-prob kernels"
    assert not auto.actor.keep_head_logits


def test_the_kept_logits_are_the_micro_batchs_response_tokens_by_the_vocabulary_in_the_heads_dtype():
    from phaserl.memory.budget import kept_logits_bytes, response_tokens_of

    shape = ModelShape(num_params=494_000_000, num_layers=24, hidden_size=896, intermediate_size=4864,
                       num_kv_heads=2, head_dim=64, vocab_size=151_936, param_bytes=2)
    assert response_tokens_of(33_024, 384, 128) == 86 * 256
    assert kept_logits_bytes(shape, 86 * 256) == 86 * 256 * 151_936 * 2


def test_the_head_keeps_logits_only_under_autograd_with_the_triton_kernels(monkeypatch):
    import torch

    from phaserl.roles import forward

    seen = []
    monkeypatch.setattr(forward, "token_logprobs_from_hidden",
                        lambda h, w, t, **kw: seen.append((kw["save_logits"], kw["chunk_size"])) or (h[:, 0], None))
    model = type("M", (), {"plain_head": True, "output_weight": torch.zeros(5, 3), "compiled": "inductor"})()
    h, t = torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)
    monkeypatch.setattr(forward, "can_save_logits", lambda fused, hidden: fused is True)  # Triton "runs"
    forward.head_logprobs(model, h, t, temperature=1.0, chunk_size=1024, with_entropy=False, keep_logits=True)
    with torch.no_grad():  # a forward-only pass has no backward to keep them for
        forward.head_logprobs(model, h, t, temperature=1.0, chunk_size=1024, with_entropy=False, keep_logits=True)
    forward.head_logprobs(model, h, t, temperature=1.0, chunk_size=1024, with_entropy=False, keep_logits=False)
    monkeypatch.setattr(forward, "can_save_logits", lambda fused, hidden: False)
    forward.head_logprobs(model, h, t, temperature=1.0, chunk_size=1024, with_entropy=False, keep_logits=True)
    assert seen == [(True, forward.KEPT_LOGITS_CHUNK), (False, 1024), (False, 1024), (False, 1024)]


def test_a_set_micro_batch_wins_over_the_rule_and_its_line_shows_the_number():
    choice = choose("ppo.micro_batch_tokens", 4096, _micro(8, 1, 384))
    assert (choice.value, choice.line()) == (4096, "ppo.micro_batch_tokens=4096 -> 4096: set in the config")
    assert choose("ppo.micro_batch_tokens", None, (32_640, "why")).line() == "ppo.micro_batch_tokens=auto -> 32640: why"
    assert load_config(None, ["ppo.micro_batch_tokens=auto"]).ppo.micro_batch_tokens is None
    with pytest.raises(ConfigError, match=r"expected an integer >= 1, or auto \(null\)"):
        load_config(None, ["ppo.micro_batch_tokens=big"])


def test_the_builder_uses_the_micro_batch_it_chose(tmp_path):
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.summary import run_summary

    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "ppo.micro_batch_tokens=auto"]))
    choice = trainer.run.speed.micro_batch_tokens
    assert choice.line() == "ppo.micro_batch_tokens=auto -> 16384: CPU (the fixed default off CUDA)"
    assert trainer.run.train_tokens == 16384 and choice.line() in run_summary(trainer)
    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path / "set")) + ["trainer.loggers=[]"]))
    assert trainer.run.train_tokens == 64 and trainer.run.speed.micro_batch_tokens.why == "set in the config"


def test_explain_shows_each_auto_rule_and_what_a_set_value_means():
    text = explain(load_config(None, ["rollout.engine_keep_awake=false"]))
    for key, rule in AUTO_RULES.items():
        assert rule in text, key
    assert "actor.compile              = auto" in text
    assert "rollout.engine_keep_awake  = false (set: the rule is not applied)" in text


def test_on_the_cpu_the_defaults_stay_eager_and_the_summary_says_why(tmp_path):
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.summary import run_summary

    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + ["trainer.loggers=[]"]))
    speed = trainer.run.speed
    assert not trainer.actor.model.compiled and not trainer.ref_policy.model.compiled
    assert trainer.actor.engine_config.keep_awake is False and trainer.actor.engine_config.compile is False
    assert speed.actor_compile.line() == "actor.compile=auto -> off: CPU (compiling costs more than it saves off CUDA)"
    assert speed.engine_keep_awake.line() == "rollout.engine_keep_awake=auto -> off: CPU (no CUDA graphs to keep)"
    assert speed.critic_compile is None and not speed.compiles and trainer.run.compile_watch is None
    summary = run_summary(trainer)
    for choice in speed.all():
        assert choice.line() in summary


def test_the_builders_keep_awake_count_of_a_loaded_run(tmp_path):
    from phaserl.config.validate import sequence_tokens
    from phaserl.memory.budget import logprob_chunk_bytes, train_bytes_per_token
    from phaserl.trainer import RLTrainer
    from phaserl.trainer.settings import Roles
    from phaserl.trainer.speed import UpdateCount

    cfg = load_config(None, make_run_dir(str(tmp_path)) + ["trainer.loggers=[]"])
    t = RLTrainer.from_config(cfg)
    roles = Roles(actor=t.actor, critic=None, ref_policy=t.ref_policy, reward=t.run.reward, tokenizer=t.run.tokenizer)
    count = UpdateCount.of(cfg, roles, free_bytes=1_000_000, held_bytes=234, compiled=False,
                           sequence_tokens=sequence_tokens(cfg))
    shape = ModelShape.of(t.actor.model)
    weights = 21_920 * 4  # the tiny float32 policy; the reference is a second copy of it
    # resident: actor weights + AdamW (2x) + reference weights; gradients of the actor; one micro-batch of
    # ppo.micro_batch_tokens = 64 tokens; the engine's pool: 512 slots x 64 tokens would be 8.4 MB, so
    # engine_memory_fraction 0.4 of the 1,000,000 B free = 400,000 B, + the weights once more.
    peak = 3 * weights + weights + weights + 64 * train_bytes_per_token(shape, False) + logprob_chunk_bytes(shape, 64)
    kept = 400_000 + weights
    assert (count.peak(64, kept=True), count.kept_bytes, count.budget_bytes) == (peak + kept, kept, 1_000_234)
    assert count.fixed_bytes(kept=True) == 3 * weights + weights + weights + kept  # what no micro-batch changes


@pytest.mark.gpu
def test_on_one_gpu_the_tiny_run_keeps_the_engine_awake_and_stays_eager(tmp_path):
    import torch

    from phaserl.trainer import RLTrainer

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "trainer.device=cuda", "rollout.engine_compile=false"]))
    speed = trainer.run.speed
    assert not speed.actor_compile.value and "small model" in speed.actor_compile.why  # 0.1M parameters
    assert speed.engine_keep_awake.value and "GiB needed of" in speed.engine_keep_awake.why
    assert trainer.actor.engine_config.keep_awake is True
    trainer.train_step()
    assert trainer.actor.engine.kept_awake  # the switch back to training kept the KV cache


@pytest.mark.gpu
def test_on_one_gpu_an_auto_micro_batch_is_the_rules_answer_on_the_builders_count(tmp_path):
    import torch

    from phaserl.trainer import RLTrainer

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "trainer.device=cuda", "rollout.engine_compile=false", "ppo.micro_batch_tokens=auto"]))
    choice, run = trainer.run.speed.micro_batch_tokens, trainer.run
    seq = 36  # the tiny run's prompt + response tokens
    # a 0.1M-parameter model leaves the activations room for the whole mini-batch, under the token cap
    assert choice.value == run.train_tokens == run.mini_batch_per_rank * seq <= MICRO_BATCH_CAP
    assert choice.why.endswith("(the mini-batch)") and "GiB of" in choice.why
    trainer.train_step()  # and the update runs with it


@pytest.mark.gpu
def test_on_one_gpu_a_compiled_actor_keeps_its_head_logits_in_the_update_and_only_there(tmp_path, monkeypatch):
    import torch

    from phaserl.roles import forward
    from phaserl.trainer import RLTrainer

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "trainer.device=cuda", "rollout.engine_compile=false", "actor.compile=true"]))
    choice = trainer.run.speed.keep_head_logits
    assert choice.value and trainer.actor.keep_head_logits and "GiB of kept logits" in choice.why
    saved, original = [], forward.token_logprobs_from_hidden
    monkeypatch.setattr(forward, "token_logprobs_from_hidden",
                        lambda *a, **kw: (saved.append((torch.is_grad_enabled(), kw["save_logits"]))
                                          or original(*a, **kw)))
    metrics = trainer.train_step()
    assert saved and all(keep == grad for grad, keep in saved)  # the update keeps them; the reference's pass cannot
    assert any(keep for _, keep in saved) and torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))


def test_explicit_settings_reach_the_roles(tmp_path, fresh_cache, monkeypatch):
    from phaserl.models import decoder
    from phaserl.trainer import RLTrainer

    cache = tmp_path / "cache"
    monkeypatch.setenv("PHASERL_CACHE_DIR", str(cache))
    trainer = RLTrainer.from_config(load_config(None, make_run_dir(str(tmp_path)) + [
        "trainer.loggers=[]", "actor.compile=true", "rollout.engine_keep_awake=true"]))
    assert trainer.actor.model.compiled and trainer.actor.engine_config.keep_awake is True
    assert trainer.run.speed.actor_compile.line() == "actor.compile=true -> on: set in the config"
    watch = trainer.run.compile_watch  # announced at build time; nothing compiled yet
    assert watch.cold and watch.cache.path == str(cache / "torch-compile")
    decoder.enable_compile(trainer.actor.model, enabled=False)  # nothing was run compiled: keep the suite fast
    decoder.enable_compile(trainer.ref_policy.model, enabled=False)


def test_the_doctor_counts_keep_awake_as_the_run_will_choose_it(tmp_path):
    from phaserl.doctor import load_doctor_config, run_doctor

    memory = {r.name: r for r in run_doctor(load_doctor_config(None, make_run_dir(str(tmp_path)))) }["memory"]
    assert "rollout.engine_keep_awake=auto -> off: CPU (no CUDA graphs to keep)" in memory.details
    assert "ppo.keep_head_logits=auto -> off: CPU: no Triton log-prob kernels" in memory.details


def test_the_doctors_kept_logits_follow_the_rule_and_a_set_value_where_the_kernels_run(monkeypatch):
    from types import SimpleNamespace

    import torch

    from phaserl.doctor import probes
    from phaserl.doctor.memory import PhaseSizes

    shape = ModelShape(num_params=494_000_000, num_layers=24, hidden_size=896, intermediate_size=4864,
                       num_kv_heads=2, head_dim=64, vocab_size=151_936, param_bytes=2)
    fields = {f: 0 for f in PhaseSizes.__dataclass_fields__}
    sizes = PhaseSizes(**{**fields, "micro_batch_tokens": 33_024, "mini_batch_per_rank": 512, "sequence_tokens": 384,
                          "prompt_tokens": 128, "gradient_checkpointing": False, "compiled": True})
    monkeypatch.setattr(probes, "supports_packing", lambda model: True)
    monkeypatch.setattr(probes.importlib.util, "find_spec", lambda name: object())  # Triton "installed"
    logits = 86 * 256 * 151_936 * 2

    def ctx(asked, free_gib=139):
        cfg = SimpleNamespace(ppo=SimpleNamespace(keep_head_logits=asked))
        return SimpleNamespace(cfg=cfg, device=torch.device("cuda"), policy=SimpleNamespace(plain_head=True),
                               free_bytes=free_gib * GIB)

    added, line = probes._keep_logits(ctx(None), shape, sizes, resident=8 * GIB, grads=GIB, kept=0)
    assert added == logits and line.startswith("ppo.keep_head_logits=auto -> on: 6.2 GiB of kept logits")
    added, line = probes._keep_logits(ctx(None, free_gib=50), shape, sizes, resident=8 * GIB, grads=GIB, kept=0)
    assert added == 0 and line.endswith("more than the room the micro-batch leaves (recomputed in backward)")
    assert (probes._keep_logits(ctx(True, free_gib=50), shape, sizes, resident=8 * GIB, grads=GIB, kept=0)
            == (logits, ""))
    assert probes._keep_logits(ctx(False), shape, sizes, resident=8 * GIB, grads=GIB, kept=0) == (0, "")


# ----- the compile cache --------------------------------------------------------------------------------------
def test_the_cache_directory_is_phaserls_unless_the_user_chose_one(tmp_path, fresh_cache, monkeypatch):
    cache = compile_cache.enable_compile_cache(str(tmp_path / "c"))
    assert (cache.path, cache.source) == (str(tmp_path / "c"), "phaserl")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c")
    assert compile_cache.enable_compile_cache(str(tmp_path / "other")) is cache  # once per process
    monkeypatch.setattr(compile_cache, "_ACTIVE", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.enable_compile_cache(str(tmp_path / "c")).source == "TORCHINDUCTOR_CACHE_DIR"


def test_an_unwritable_cache_directory_warns_and_leaves_torchs_default(tmp_path, fresh_cache, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        cache = compile_cache.enable_compile_cache(str(blocker / "cache"))
    assert cache.path is None and cache.problem and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert "cannot be written" in caplog.text and str(blocker / "cache") in caplog.text


def test_a_corrupt_cache_entry_is_moved_aside_and_the_call_compiles_again(tmp_path, fresh_cache, caplog, monkeypatch):
    import torch
    from torch._dynamo.exc import BackendCompilerFailed

    cache = compile_cache.enable_compile_cache(str(tmp_path / "c"))
    (tmp_path / "c" / "entry.py").write_text("garbage")
    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))

    def compiled(x):  # a generated module in the cache that runs into an error while torch.compile loads it
        calls.append(x)
        if len(calls) == 1:
            try:
                exec(compile("this is not python", f"{cache.path}/entry.py", "exec"), {})
            except NameError as inner:
                failure = BackendCompilerFailed.__new__(BackendCompilerFailed)  # its __init__ differs by version
                Exception.__init__(failure, f"backend='inductor' raised: NameError: {inner}")
                raise failure from inner
        return x + 1

    with caplog.at_level(logging.WARNING, logger="phaserl"):
        assert compile_cache.guard_compiled(compiled)(1) == 2
    assert calls == [1, "reset", 1]
    moved = [p for p in os.listdir(tmp_path) if p.startswith("c.corrupt-")]
    assert len(moved) == 1 and (tmp_path / moved[0] / "entry.py").is_file()
    assert os.listdir(tmp_path / "c") == [] and "moved it to" in caplog.text

    def unrelated(x):
        raise ValueError(f"a shape error of the model itself, in {cache.path}/generated.py")

    with pytest.raises(ValueError, match="shape error"):  # the compiled code's own errors pass through
        compile_cache.guard_compiled(unrelated)(1)


def test_the_watch_announces_cold_then_warm_and_survives_a_damaged_record(tmp_path, fresh_cache, caplog):
    cache = compile_cache.enable_compile_cache(str(tmp_path / "c"))
    first = compile_cache.CompileWatch("the decoder layers", "k", cache, device_type="cuda")
    assert first.cold and first.announce() == ("compile: compiling the decoder layers (first run on this machine: "
                                               f"~40 s; cached afterwards in {cache.path})")
    assert first.step_done(12.34).startswith("compile: first step 12.3 s, of which torch.compile")
    assert first.step_done(1.0) is None and first.report["first_step_s"] == 12.34
    second = compile_cache.CompileWatch("the decoder layers", "k", cache, device_type="cuda")
    assert not second.cold and "from the cache" in second.announce() and "took 12.3 s then" in second.announce()
    assert compile_cache.CompileWatch("x", "other key", cache, device_type="cuda").cold
    (tmp_path / "c" / compile_cache.RECORD).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="phaserl"):
        assert compile_cache.CompileWatch("x", "k", cache, device_type="cuda").cold
    assert "ignoring" in caplog.text


# ----- two processes, inductor on the CPU ---------------------------------------------------------------------
CHILD = r"""
import json, sys, time, torch
torch.set_num_threads(1)
from phaserl import compile_cache
from phaserl.models.config import DecoderConfig
from phaserl.models.decoder import CausalLM, enable_compile
compile_cache.enable_compile_cache(sys.argv[1])
torch.manual_seed(0)
model = CausalLM(DecoderConfig(model_type="qwen2", vocab_size=50, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64, tie_word_embeddings=True, attention_bias=True))
enable_compile(model)  # inductor: C++ kernels on the CPU
t0 = time.perf_counter()
with torch.no_grad():
    out = model(torch.randint(0, 50, (2, 8)))
hits, misses = compile_cache._cache_counts()
print(json.dumps({"seconds": time.perf_counter() - t0, "hits": hits, "misses": misses,
                  "sum": float(out.double().sum())}))
"""


def _child(cache: str) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", CHILD, cache], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow  # three processes compile with inductor (C++): ~1-2 min on a 2-core CPU
def test_a_second_process_compiles_from_the_first_ones_cache_and_a_corrupt_one_recompiles(tmp_path):
    import shutil

    cache = str(tmp_path / "cache")
    cold, _ = _child(cache)
    warm, _ = _child(cache)
    assert cold["misses"] > 0 and cold["hits"] == 0
    assert warm["hits"] == cold["misses"] and warm["misses"] == 0
    assert warm["seconds"] < cold["seconds"] and warm["sum"] == cold["sum"]
    broken = str(tmp_path / "broken")
    shutil.copytree(cache, broken)
    modules = [os.path.join(d, f) for d, _, files in os.walk(broken) for f in files if f.endswith(".py")]
    assert modules  # inductor's generated wrapper modules
    for path in modules:
        with open(path, "w") as f:
            f.write("this is not python")
    again, stderr = _child(broken)  # a cache torch itself cannot load: a warning and a cold compile, no crash
    assert again["sum"] == cold["sum"] and "moved it to" in stderr


def test_the_removed_extend_graphs_key_is_an_error_that_says_what_to_do():
    """rollout.engine_extend_graphs (graphed multi-turn continuation passes) was removed: in YAML or on the command
    line it is an error naming the key, why it went and what to do, not a guess at another key."""
    from phaserl.config.load import config_from_dict
    from phaserl.errors import ConfigError

    for load in (lambda: load_config(None, ["rollout.engine_extend_graphs=true"]),
                 lambda: config_from_dict({"rollout": {"engine_extend_graphs": True}}, source="cfg.yaml")):
        with pytest.raises(ConfigError, match=r"rollout.engine_extend_graphs was removed: .*delete the key"):
            load()
