"""Routing replay (actor.routing_replay): the rollout engine records the experts every MoE layer chose at every
position, they travel with the batch (RolloutBatch.routed_experts, packed or padded), and the training forward
routes with them, recomputing only the gate weights. The router's aux loss joins the actor loss when the model's
config asks for it."""
import json
import math

import pytest
import torch
import transformers

from phaserl.batch import RolloutBatch, layout_routes
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, DecoderConfig, moe
from phaserl.roles.forward import batch_logprobs, rows_logprobs
from phaserl.rollout import EngineConfig, RolloutEngine, SamplingParams
from phaserl.trainer.dynamic_sampling import concat_batches

torch.set_num_threads(1)

E, K = 8, 2
PROMPTS = [[5, 6, 7, 8], [1, 2, 3], [9, 10, 11, 12, 13, 14]]


def tiny_moe(seed: int = 0, **changes) -> CausalLM:
    shape = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 qk_norm=True, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=16,
                 norm_topk_prob=True, mlp_only_layers=(1,))
    cfg = DecoderConfig(**{**shape, **changes})
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():  # a router far from init: its top-k is decisive, not a near-tie
        for layer in model.model.layers:
            if layer.spec.moe is not None:
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    return model.eval()


def sample(model, n=2, max_new=6, seed=0):
    prompts = [p for p in PROMPTS for _ in range(n)]
    engine = RolloutEngine(model, EngineConfig(record_routes=True, max_slots=4))
    result = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=1.0), eos_token_ids=[],
                             pad_token_id=0, generator=torch.Generator().manual_seed(seed))
    return prompts, result


def forward_experts(model, ids, replay=None):
    routing = moe.Routing(replay=replay)
    with torch.no_grad():
        model(torch.tensor([ids]), routing=routing)
    return routing.experts()  # [T, L, k]


def test_the_engine_records_the_experts_the_uncached_forward_chooses():
    model = tiny_moe()
    prompts, result = sample(model)
    for prompt, response, routes in zip(prompts, result.response_ids, result.routes):
        seq = prompt + response
        assert routes.shape == (len(seq), 2, K) and routes.dtype == torch.int16
        assert (routes[-1] == -1).all()  # the last sampled token is never fed
        expected = forward_experts(model, seq)[:-1]
        # per position the set of k experts (top-k order can differ on a tie, the set cannot)
        assert torch.equal(routes[:-1].long().sort(-1).values, expected.sort(-1).values)


def perturb_router(model, scale=0.8, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.spec.moe is not None:
                layer.mlp.gate.weight.add_(scale * torch.randn(layer.mlp.gate.weight.shape, generator=g))


def rollout_batch(prompts, result) -> RolloutBatch:
    P, R = max(map(len, prompts)), max(map(len, result.response_ids))
    B = len(prompts)
    ids = torch.zeros(B, P + R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, result.response_ids)):
        ids[i, P - len(p):P], ids[i, P:P + len(r)] = torch.tensor(p), torch.tensor(r)
        attention[i, P - len(p):P + len(r)] = 1
    routes = layout_routes(list(map(len, prompts)), result.routes, P, R)
    return RolloutBatch(input_ids=ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
                        response_mask=attention[:, P:], prompt_width=P, group_ids=torch.arange(B),
                        rollout_logprobs=torch.zeros(B, R), prompts=prompts, response_texts=[""] * B,
                        rows=[None] * B, finish_reasons=["length"] * B, routed_experts=routes)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_replay_routes_training_like_the_rollout_even_when_the_router_moved(packing):
    model = tiny_moe()
    prompts, result = sample(model)
    batch = rollout_batch(prompts, result)
    perturb_router(model)  # as an optimizer step (or bf16 noise) would: the router's own top-k changes
    idx = torch.arange(len(prompts))
    real = batch.attention_mask.bool()  # [B, S]
    recorded = batch.routed_experts[real].long()  # [N, L, k] in packing order (row by row, real tokens)
    fed = recorded[:, 0, 0] >= 0  # every position but each row's last token
    used = {}
    for replay in (True, False):
        routing = moe.Routing()
        if not replay:
            batch.routed_experts, saved = None, batch.routed_experts
        with torch.no_grad():
            rows_logprobs(model, batch, idx, packing=packing, temperature=1.0, with_entropy=False, routing=routing)
        if not replay:
            batch.routed_experts = saved
        experts = routing.experts()  # [N or b*S, L, k]
        used[replay] = experts if packing else experts.view(*real.shape, 2, K)[real]
    assert torch.equal(used[True][fed], recorded[fed])
    assert not torch.equal(used[False][fed].sort(-1).values, recorded[fed].sort(-1).values)


def test_replay_changes_the_log_probs_only_through_the_experts():
    # With the router unmoved, replaying the rollout's own choices gives the log-probs of no replay.
    model = tiny_moe()
    prompts, result = sample(model)
    batch = rollout_batch(prompts, result)
    with_replay = batch_logprobs(model, batch, temperature=1.0, token_budget=64, packing=True, replay=True)
    without = batch_logprobs(model, batch, temperature=1.0, token_budget=64, packing=True, replay=False)
    torch.testing.assert_close(with_replay, without, atol=1e-5, rtol=0)
    perturb_router(model)
    moved = batch_logprobs(model, batch, temperature=1.0, token_budget=64, packing=True, replay=True)
    moved_free = batch_logprobs(model, batch, temperature=1.0, token_budget=64, packing=True, replay=False)
    assert (moved - moved_free).abs().max() > 1e-4


def test_the_gate_weights_stay_differentiable_under_replay():
    model = tiny_moe().train()
    prompts, result = sample(model)
    batch = rollout_batch(prompts, result)
    routing = moe.Routing()
    logp, _, mask = rows_logprobs(model, batch, torch.arange(len(prompts)), packing=True, temperature=1.0,
                                  with_entropy=False, routing=routing)
    (logp * mask).sum().backward()
    router = model.model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_routes_join_and_trim_like_the_tokens():
    model = tiny_moe()
    prompts, result = sample(model)
    a = rollout_batch(prompts[:2], type(result)(result.response_ids[:2], result.logprobs[:2],
                                                result.finish_reasons[:2], result.routes[:2]))
    b = rollout_batch(prompts[4:], type(result)(result.response_ids[4:], result.logprobs[4:],
                                                result.finish_reasons[4:], result.routes[4:]))
    joined = concat_batches([a, b], pad_token_id=0)
    for part, rows in ((a, slice(0, 2)), (b, slice(2, 4))):
        real = part.attention_mask.bool()
        assert torch.equal(joined.routed_experts[rows][joined.attention_mask[rows].bool()], part.routed_experts[real])
    assert (joined.routed_experts[~joined.attention_mask.bool()] == -1).all()


def test_routing_replay_needs_a_native_moe_actor_and_the_builtin_engine(tmp_path):
    from phaserl.config import load_config
    from phaserl.roles import HybridActor

    dense = CausalLM(DecoderConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ConfigError, match="routing_replay=true needs a mixture-of-experts"):
        HybridActor(dense).setup_routing(replay=True)
    actor = HybridActor(tiny_moe())
    actor.setup_routing(replay=False)
    assert actor.router_aux == (0.0, K)  # the model's config asks for no aux loss: none is added
    with pytest.raises(ConfigError, match="rollout.engine = hf"):
        load_config(None, ["actor.routing_replay=true", "rollout.engine=hf"])


@pytest.mark.slow
def test_a_train_step_replays_routes_and_adds_the_aux_loss(tmp_path, monkeypatch):
    from _tiny_run import make_prompt_files
    from _tiny_tokenizer import build_tiny_tokenizer
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    tokenizer = build_tiny_tokenizer()
    hf = transformers.Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                                     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                     max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id, output_router_logits=True,
                                     router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(hf).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    train, val = make_prompt_files(str(tmp_path), n_train=8, n_val=2)
    cfg = load_config(None, [
        f"model.path={tmp_path / 'model'}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
        "data.max_prompt_length=32", "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.n=2",
        "rollout.batch_size=2", "trainer.total_steps=1", "trainer.device=cpu", "trainer.loggers=[jsonl]",
        f"trainer.log_dir={tmp_path / 'logs'}", f"trainer.checkpoint_path={tmp_path / 'ckpt'}",
        "ppo.micro_batch_tokens=64", "ppo.forward_micro_batch_tokens=128", "ppo.packing=true",
        "actor.routing_replay=true"])
    import phaserl.roles.actor as actor_module

    replayed = []  # per update forward: the routes it replayed

    def spy(*args, routing=None, **kwargs):
        out = actor_module_rows_logprobs(*args, routing=routing, **kwargs)
        replayed.append(None if routing is None else routing.replay)
        return out
    actor_module_rows_logprobs = actor_module.rows_logprobs
    monkeypatch.setattr(actor_module, "rows_logprobs", spy)
    trainer = RLTrainer.from_config(cfg)
    trainer.fit()
    line = [json.loads(x) for x in open(tmp_path / "logs" / "metrics.jsonl")][-1]
    assert line["actor/router_aux_loss"] > 0 and math.isfinite(line["actor/grad_norm"])
    assert "mismatch/abs_diff_mean" in line
    assert replayed and all(r is not None and r.shape[-2:] == (2, 2) and (r >= 0).any() for r in replayed)
    # the trained checkpoint (DCP, stacked experts) exports to per-expert files transformers loads, same logits
    from phaserl.checkpoint import export_checkpoint

    out = export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([[5, 9, 14, 3, 7, 21]])
    actor = trainer.actor.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, actor.logits(actor(ids)), atol=1e-5, rtol=1e-5)


def test_the_doctors_mismatch_probe_replays_when_the_run_does():
    from phaserl.roles import HybridActor
    from phaserl.roles.mismatch_probe import measure_mismatch

    actor = HybridActor(tiny_moe())
    metrics, tokens, path, _, _ = measure_mismatch(
        actor, PROMPTS, n=2, engine="builtin", max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
        eos_token_ids=[], pad_token_id=0, token_budget=256, seed=0, replay=True)
    assert tokens == 24 and path == "builtin engine"
    assert metrics["mismatch/abs_diff_max"] < 1e-4  # fp32 on the CPU: the same experts, the same numbers
    assert actor.engine.runner.record_routes


def test_gradient_checkpointing_recomputes_the_replayed_routing_exactly():
    model = tiny_moe()
    prompts, result = sample(model)
    batch = rollout_batch(prompts, result)
    perturb_router(model)
    grads = []
    for checkpointed in (False, True):
        model.zero_grad()
        model.train()
        model.gradient_checkpointing = checkpointed
        routing = moe.Routing()
        logp, _, mask = rows_logprobs(model, batch, torch.arange(len(prompts)), packing=True, temperature=1.0,
                                      with_entropy=False, routing=routing)
        (-(logp * mask).sum() + 0.1 * routing.aux_loss(K)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-6)


def test_multi_turn_episodes_record_the_experts_of_every_fed_position():
    """agent.env episodes with routing replay: the slot's record (prompt, sampled turns, appended observations,
    across refills and the session's slot swaps) is laid out like the episode's ids, and at every fed position it
    holds the experts the uncached forward of the whole conversation chooses. It used to be a config error."""
    from phaserl.agents.episodes import AgentLimits, EpisodeRunner
    from phaserl.agents.loader import EnvironmentFactory
    from phaserl.trainer.episode_batch import episodes_batch
    from tests import _agent_envs as envs
    from tests.test_agents_episodes import EOS, TOK, starts

    model = tiny_moe(vocab_size=len(TOK), max_position_embeddings=64)
    lim = AgentLimits(max_turns=4, max_turn_tokens=4, max_episode_tokens=64, context_limited=False,
                      step_timeout_s=10.0, on_env_error="end", workers=4, overlap=False)
    runner = EpisodeRunner(EnvironmentFactory(envs.Feedback, dict(turns=3, observation="ab")), TOK, lim)
    engine = RolloutEngine(model, EngineConfig(max_slots=4, record_routes=True))  # 6 episodes, 4 slots: refills
    with engine.session(SamplingParams(max_new_tokens=4, temperature=1.0), slot_len=64, eos_token_ids=[EOS],
                        generator=torch.Generator().manual_seed(0)) as session:
        episodes = runner.run_session(session, starts())
        swaps = session.stats.swaps
    assert swaps > 0  # resumed sequences moved slots: their records moved with their KV
    batch = episodes_batch(episodes, 2, tokenizer=TOK, pad_token_id=0, group_offset=0, device="cpu")
    assert batch.routed_experts.shape == (*batch.input_ids.shape, 2, K)
    P = batch.prompt_width
    for i, ep in enumerate(episodes):
        seq = ep.prompt_ids + ep.response_ids()
        start = P - len(ep.prompt_ids)
        routes = batch.routed_experts[i, start:start + len(seq)]
        assert (batch.routed_experts[i, :start] == -1).all()
        assert (batch.routed_experts[i, start + len(seq):] == -1).all()
        assert (routes[-1] == -1).all() and (routes[:-1] >= 0).all()  # all fed but the last sampled id
        expected = forward_experts(model, seq)[:-1]
        assert torch.equal(routes[:-1].long().sort(-1).values, expected.sort(-1).values)


def test_routing_replay_with_an_agent_harness_is_a_config_error():
    import os

    from phaserl.config import load_config

    harness = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "agent_harness.py")
    with pytest.raises(ConfigError, match="agent.harness"):
        load_config(None, ["actor.routing_replay=true", f"agent.harness={harness}:harness"])
    load_config(None, ["actor.routing_replay=true", "agent.env=phaserl.world.agent_task:RetryArithmetic"])


@pytest.mark.slow  # a trainer step end to end
def test_a_multi_turn_train_step_replays_the_episodes_routes(tmp_path, monkeypatch):
    import os

    import phaserl.roles.actor as actor_module
    from _tiny_run import make_model_dir, make_prompt_files
    from phaserl.config import load_config
    from phaserl.trainer import RLTrainer

    model = make_model_dir(str(tmp_path), model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=16, head_dim=8, qk_norm=True)
    train, val = make_prompt_files(str(tmp_path), n_train=8, n_val=2)
    envs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_agent_envs.py")
    cfg = load_config(None, [
        f"model.path={model}", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.max_prompt_length=32",
        "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.batch_size=2",
        f"agent.env={envs}:Feedback", "agent.max_turns=3", "agent.max_episode_tokens=96", "trainer.total_steps=1",
        "trainer.device=cpu", "trainer.loggers=[]", f"trainer.log_dir={tmp_path / 'logs'}",
        f"trainer.checkpoint_path={tmp_path / 'ckpt'}", "ppo.micro_batch_tokens=128",
        "ppo.forward_micro_batch_tokens=256", "actor.routing_replay=true"])
    replayed = []
    original = actor_module.rows_logprobs

    def spy(*args, routing=None, **kwargs):
        out = original(*args, routing=routing, **kwargs)
        replayed.append(None if routing is None else routing.replay)  # set by the call from the batch's routes
        return out
    monkeypatch.setattr(actor_module, "rows_logprobs", spy)
    trainer = RLTrainer.from_config(cfg)
    metrics = trainer.train_step()
    assert metrics["agent/turns_mean"] > 1 and metrics["train/skipped_step"] == 0
    assert replayed and all(r is not None and (r >= 0).any() for r in replayed)
    assert "mismatch/abs_diff_mean" in metrics
