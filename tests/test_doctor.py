"""`phaserl doctor`: one line per check, OK / WARN / FAIL with the fix, on tiny CPU setups.

The memory arithmetic is checked against hand-worked numbers; every other check is run on a real
tiny model, tokenizer and prompt files (tests/_tiny_run.py) with one thing broken at a time.
"""
import dataclasses
import re

import pytest
import torch

from _tiny_rm import make_reward_model_dir
from _tiny_run import make_run_dir
from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.doctor import (
    FAIL,
    OK,
    WARN,
    CheckResult,
    any_failed,
    format_report,
    load_doctor_config,
    memory,
    run_doctor,
)
from phaserl.doctor.memory import PhaseSizes, Suggestion
from phaserl.errors import ConfigError
from phaserl.memory import budget
from phaserl.memory.budget import ModelShape

torch.set_num_threads(1)

CHECK_NAMES = ["config rules", "parallel settings", "batch sizes", "rollout mode", "shared paths", "device", "model",
               "write paths",
               "tokenizer/model", "context length", "data", "chat template", "vision rows",
               "reward functions", "agent episode",
               "reward model", "reference frozen", "memory", "rollout/training mismatch"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("doctor"))
    return {"root": root, "overrides": make_run_dir(root)}


def doctor(run, *extra, world_size=1) -> dict:
    results = run_doctor(load_doctor_config(None, run["overrides"] + list(extra)), world_size=world_size)
    assert [r.name for r in results] == CHECK_NAMES
    return {r.name: r for r in results}


# ---- report formatting ---------------------------------------------------------------------------

def test_report_has_one_line_per_check_with_the_fix_after_an_arrow():
    results = [CheckResult("data", OK, "64 rows"),
               CheckResult("reward model", FAIL, "scores are NaN", fix="check the chat template"),
               CheckResult("memory", WARN, "2 problems:\n- a\n- b", fix="smaller batches", details=("x = 1",))]
    assert format_report(results).splitlines() == [
        "OK   data          64 rows",
        "FAIL reward model  scores are NaN → check the chat template",
        "WARN memory        2 problems:",
        "                   - a",
        "                   - b",
        "                   → smaller batches",
        "                   x = 1",
        "3 checks: 1 OK, 1 WARN, 1 FAIL; the run would fail or waste GPU time: fix the FAIL lines first",
    ]
    assert any_failed(results) and not any_failed(results[:1] + results[2:])


def test_an_ok_line_never_shows_a_fix():
    assert format_report([CheckResult("x", OK, "fine", fix="unused")]).splitlines()[0] == "OK   x  fine"


# ---- memory arithmetic (hand-worked) ----------------------------------------------------------------
# A 2-layer model: hidden 32, MLP 64, 2 KV heads of dim 8, vocabulary 100, float32.
SHAPE = ModelShape(num_params=1000, num_layers=2, hidden_size=32, intermediate_size=64, num_kv_heads=2, head_dim=8,
                   vocab_size=100, param_bytes=4)
SIZES = PhaseSizes(n=2, prompt_tokens=32, sequence_tokens=36, rollout_batch_size=4, prompts_per_rank=4,
                   rm_engine="transformers", rm_batch_size=16, rm_micro_batch_tokens=256, rm_packed=False,
                   rm_max_length=64, responses_per_rank=8, micro_batch_tokens=64,
                   mini_batch_per_rank=8, gradient_checkpointing=False)


def test_kv_cache_is_two_times_layers_heads_dim_bytes_tokens():
    assert budget.kv_cache_bytes_per_sequence(SHAPE, 36) == 2 * 2 * 2 * 8 * 4 * 36 == 9216


def test_role_memory_per_sharding_strategy():
    # 1000 params × 4 B = 4000 B; grads 4000; AdamW two moments 8000.
    kw = dict(trainable=True, world_size=2, cpu_offload=False)
    assert budget.role_memory(1000, 4, strategy="FULL_SHARD", **kw) == budget.RoleMemory(2000, 2000, 4000)
    assert budget.role_memory(1000, 4, strategy="SHARD_GRAD_OP", **kw) == budget.RoleMemory(4000, 2000, 4000)
    assert budget.role_memory(1000, 4, strategy="NO_SHARD", **kw) == budget.RoleMemory(4000, 4000, 8000)
    frozen = budget.role_memory(1000, 4, trainable=False, strategy="FULL_SHARD", world_size=2, cpu_offload=False)
    assert frozen == budget.RoleMemory(2000, 0, 0)
    assert budget.role_memory(1000, 4, strategy="NO_SHARD", trainable=True, world_size=1, cpu_offload=True).total == 0


def test_per_item_costs_of_each_phase():
    # update: per layer 8·32 + 4·64 + 2·2·8 = 544 values per token; × 2 layers × 4 B = 4352
    assert budget.train_bytes_per_token(SHAPE, gradient_checkpointing=False) == 4352
    # checkpointing keeps one hidden state per layer plus one layer's worth: (2·32 + 544) × 4 = 2432
    assert budget.train_bytes_per_token(SHAPE, gradient_checkpointing=True) == 2432
    # rollout: KV 9216 + prefill (2·32 + 2·64) × 4 B × 32 prompt tokens = 24576 + two float32 vocab rows 800
    assert memory.rollout_bytes_per_sequence(SHAPE, SIZES) == 9216 + 24576 + 800
    # log-probs: logits, log-softmax and gradient, float32, for at most 1024 tokens at a time
    assert budget.logprob_chunk_bytes(SHAPE, 36) == 3 * 36 * 100 * 4
    assert budget.logprob_chunk_bytes(SHAPE, 5000) == 3 * 1024 * 100 * 4


def test_suggestions_fill_the_free_memory_up_to_what_each_phase_uses():
    # usable = 0.85 × 1_000_000 = 850_000. rollout: 2 × 34_592 B per prompt → 12 fit, capped at 4 prompts.
    # update: one 36-token sequence costs 36 × (4352 + 1200 log-prob bytes) = 199_872 B → 4 sequences = 144 tokens.
    rollout, update = memory.suggest_sizes(SHAPE, None, SIZES, resident=0, update_extra=0, free_bytes=1_000_000)
    assert (rollout.key, rollout.fits, rollout.cap) == ("rollout.batch_size", 4, 4)
    assert (update.key, update.fits, update.cap) == ("ppo.micro_batch_tokens", 144, 8 * 36)
    assert memory.judge(rollout, SIZES, device_type="cuda") == memory.judge(update, SIZES, device_type="cpu") == ""


def test_a_size_that_does_not_fit_is_named_with_what_fits():
    # 1_500_000 B of resident weights leave 200_000: 200_000 // 69_184 = 2 prompts per generate call.
    rollout, update = memory.suggest_sizes(SHAPE, None, SIZES, resident=1_500_000, update_extra=0,
                                           free_bytes=2_000_000)
    # update: 200_000 // 199_872 = 1 sequence = 36 tokens, and 64 configured tokens hold just one sequence.
    assert rollout.fits == 2 and update.fits == 36
    assert memory.judge(update, SIZES, device_type="cpu") == ""
    assert memory.judge(rollout, SIZES, device_type="cpu").startswith("rollout.batch_size = 4 likely does not fit")
    assert "; 2 fit" in memory.judge(rollout, SIZES, device_type="cpu")


# The RM on phaserl's decoder (engine phaserl) has the shape of SHAPE, max_length 64 and 8 responses per rank.
PHASERL_RM = dataclasses.replace(SIZES, rm_engine="phaserl", rm_micro_batch_tokens=256, rm_packed=False)


def test_scoring_on_phaserl_costs_per_token_and_padding_adds_the_mask():
    # forward temporaries (2·32 + 2·64) × 4 B = 768 per token, no KV cache; right-padded rows add a
    # [b, 1, T, T] boolean mask and SDPA's float32 copy of it: 64 × (1 + 4) = 320 per token at T = max_length 64.
    assert budget.scoring_bytes_per_token(SHAPE, 64, packed=True) == 768
    assert budget.scoring_bytes_per_token(SHAPE, 64, packed=False) == 768 + 320
    # the transformers engine keeps its per-sequence cost: KV 2·2·2·8·4·64 = 16_384 + 768 × 64 tokens = 65_536
    assert budget.scoring_bytes_per_sequence(SHAPE, 64) == 65_536


def test_the_scoring_suggestion_names_the_key_of_the_engine():
    # 300_000 B for the scoring phase (0.85 × 1_000_000 − 550_000 resident).
    kw = dict(resident=550_000, update_extra=0, free_bytes=1_000_000)
    _, tokens, _ = memory.suggest_sizes(SHAPE, SHAPE, PHASERL_RM, **kw)
    # phaserl: 300_000 // 1_088 B per padded token = 275 tokens, of at most 8 responses × 64 tokens = 512.
    assert (tokens.key, tokens.fits, tokens.cap, tokens.per_item) == ("reward_model.micro_batch_tokens", 275, 512, 1088)
    assert memory.judge(tokens, PHASERL_RM, device_type="cuda") == ""  # 256 configured tokens ≤ 275
    packed = dataclasses.replace(PHASERL_RM, rm_packed=True)
    assert memory.suggest_sizes(SHAPE, SHAPE, packed, **kw)[1].fits == 390  # 300_000 // 768
    # transformers: 300_000 // 65_536 B per sequence = 4 of the 8 responses; 16 configured use all 8.
    _, rows, _ = memory.suggest_sizes(SHAPE, SHAPE, SIZES, **kw)
    assert (rows.key, rows.fits, rows.cap) == ("reward_model.batch_size", 4, 8)
    assert memory.judge(rows, SIZES, device_type="cpu") == ("reward_model.batch_size = 16 likely does not fit: its "
                                                           "phase needs ~512.0 KB on top of the weights; 4 fit")


def test_a_token_budget_under_max_length_still_scores_one_full_input():
    # micro_batch_tokens = 32 < max_length 64: a 64-token input goes alone, 64 × 1_088 B = 68.0 KB. With 60_000 B
    # free for scoring not even one fits (55 tokens), so the suggestion is 0: the smallest forward does not fit.
    sizes = dataclasses.replace(PHASERL_RM, rm_micro_batch_tokens=32)
    _, tokens, _ = memory.suggest_sizes(SHAPE, SHAPE, sizes, resident=790_000, update_extra=0, free_bytes=1_000_000)
    assert tokens.fits == 0 and memory.effective(tokens, sizes) == 64
    assert memory.judge(tokens, sizes, device_type="cpu") == ("reward_model.micro_batch_tokens = 32 likely does not "
                                                             "fit: its phase needs ~68.0 KB on top of the weights; "
                                                             "0 fit")
    # 64 tokens, a quarter of the 275 that fit (300_000 B free for scoring) and under all 512: idle on a GPU.
    idle = dataclasses.replace(PHASERL_RM, rm_micro_batch_tokens=64)
    _, tokens, _ = memory.suggest_sizes(SHAPE, SHAPE, idle, resident=550_000, update_extra=0, free_bytes=1_000_000)
    assert "uses under 25% of what fits (275)" in memory.judge(tokens, idle, device_type="cuda")


def test_a_tiny_size_on_a_big_gpu_is_called_idle_but_not_on_the_cpu():
    s = Suggestion("rollout.batch_size", configured=1, fits=4, cap=4, per_item=10)
    assert "uses under 25% of what fits (4)" in memory.judge(s, SIZES, device_type="cuda")
    assert memory.judge(s, SIZES, device_type="cpu") == ""


# ---- the doctor on a real tiny run -----------------------------------------------------------------

def test_a_good_tiny_config_passes_every_check(run):
    results = doctor(run)
    assert not any_failed(results.values())
    assert all(r.status == OK for r in results.values()), format_report(list(results.values()))
    # Regression: a single-process run under /tmp (node-local) is not a warning; and one
    # process gets no multi-node storage advice, nor a table of FSDP settings that apply only from 2 ranks on.
    assert "single process: nothing to share" in results["shared paths"].message
    assert "node-local" not in results["shared paths"].message
    assert results["parallel settings"].message.startswith("one process: no sharding")
    assert results["parallel settings"].details == ()
    # <|im_start|> user \n 3+4 <|im_end|> \n <|im_start|> assistant \n: 1 + 4 + 1 + 3 + 1 + 1 + 1 + 9 + 1 = 22
    assert "train: 64 rows, longest prompt 22 tokens, 0 dropped, 0 truncated; val: 8 rows" in results["data"].message
    assert results["tokenizer/model"].message.startswith("100 tokens ≤ 100 embedding rows; eos '<|im_end|>' (id 1)")
    assert results["context length"].message.startswith("prompt + response ≤ 32 + 4 = 36 tokens of the model's 256")
    assert "'<|im_start|>user\\n" in results["chat template"].message
    assert results["reward model"].message == "no reward model (reward_model.enable = false)"
    details = "\n".join(results["memory"].details)
    assert "2 × 2 layers × 2 kv heads × 8 head dim × 4 B × 36 tokens = 9.0 KB per sequence" in details
    assert ("suggested for this machine: ppo.micro_batch_tokens=288  (ppo.micro_batch_tokens: up to 288 fit (all one "
            "step can use), so fewer passes)") in details  # rollout.batch_size = 4 already fits: not listed
    assert "CUDA allocator" not in details  # a CPU run: the allocator is not touched (cuda_allocator.py)


def test_a_size_that_fits_is_not_lowered(run):
    """the quickstart's ppo.micro_batch_tokens = 8192 fits, and one step fills 5120 of it; the doctor
    suggested 5120 without saying why. A size that fits is left alone; one that does not is lowered, with why."""
    details = "\n".join(doctor(run, "ppo.micro_batch_tokens=8192",
                              "ppo.forward_micro_batch_tokens=8192")["memory"].details)
    assert "suggested for this machine: the configured sizes (each fits this machine)" in details
    low = "\n".join(doctor(run, "trainer.device=cpu")["memory"].details)
    assert "ppo.micro_batch_tokens: up to 288 fit" in low


def test_the_mismatch_check_measures_one_sampled_batch(run):
    result = doctor(run, "rollout.temperature=0.7")["rollout/training mismatch"]
    assert result.status == OK and result.message.startswith("32 sampled tokens (builtin engine, T = 0.7)"), result
    hf = doctor(run, "rollout.engine=hf")["rollout/training mismatch"]
    assert hf.status == OK and "transformers generate" in hf.message


def test_a_trainer_that_ignores_the_temperature_is_caught_by_the_mismatch_check(run, monkeypatch):
    import phaserl.roles.mismatch_probe as check

    right = check.batch_logprobs
    monkeypatch.setattr(check, "batch_logprobs", lambda *a, **kw: right(*a, **{**kw, "temperature": 1.0}))
    result = doctor(run, "rollout.temperature=0.3")["rollout/training mismatch"]
    assert result.status == WARN and "algorithm.rollout_correction" in result.fix, result


def test_each_broken_rule_is_reported_once_under_the_check_that_owns_it(run):
    results = doctor(run, "critic.hybrid_engine={enable_rollout_optimization_switch: true}",
                     "rollout.prompts_per_step=5", "ppo.num_mini_batches=4", "rollout.val_n=2")
    assert results["parallel settings"].status == FAIL
    assert results["parallel settings"].message.startswith("critic.hybrid_engine must be null: only the actor")
    assert results["batch sizes"].status == FAIL
    assert "5 × 2 = 10 responses per step do not split into ppo.num_mini_batches = 4" in results["batch sizes"].message
    assert results["config rules"].status == FAIL
    assert results["config rules"].message.startswith("rollout.val_n = 2 with rollout.val_temperature = 0")
    assert "critic.hybrid_engine" not in results["config rules"].message
    assert "suggested for this machine" in "\n".join(results["memory"].details)


def test_ignored_settings_are_a_warning(run):
    results = doctor(run, "critic.enable=true")
    assert results["config rules"].status == WARN
    assert "critic.enable = true but algorithm.adv_estimator = grpo" in results["config rules"].details[0]


def test_overlong_prompts_fail_with_the_row_or_are_counted(run):
    failed = doctor(run, "data.max_prompt_length=18")["data"]
    assert failed.status == FAIL and "train.jsonl" in failed.message
    assert "over data.max_prompt_length=18" in failed.message
    # Every tiny prompt is 22 tokens, 19 of them the chat template's: truncation keeps 2 of the 3 user characters.
    cut = doctor(run, "data.max_prompt_length=21", "data.overlong_prompts=truncate_left")["data"]
    assert cut.status == WARN and cut.message.startswith("72 prompt(s) are cut or dropped")
    assert "train: 64 rows, longest prompt 21 tokens, 0 dropped, 64 truncated" in cut.message
    assert "raise data.max_prompt_length" in cut.fix
    refused = doctor(run, "data.max_prompt_length=18", "data.overlong_prompts=truncate_left")["data"]
    assert refused.status == FAIL and "even with its last user message emptied" in refused.message
    dropped = doctor(run, "data.max_prompt_length=18", "data.overlong_prompts=drop")["data"]
    assert dropped.status == FAIL and dropped.message.startswith("all 64 prompts")


def test_a_single_cut_prompt_is_reported(run, tmp_path):
    # Regression: the doctor used to stay OK until over 10% of the prompts were cut.
    from phaserl.data import write_records

    rows = [{"prompt": "1+1", "reward_model": {"ground_truth": "2"}}] * 20
    write_records(tmp_path / "long.jsonl",
                  rows + [{"prompt": "1+1 and then some", "reward_model": {"ground_truth": "2"}}])
    result = doctor(run, f"data.train_files=[{tmp_path / 'long.jsonl'}]", "data.val_files=[]",
                    "data.max_prompt_length=24", "data.overlong_prompts=truncate_right")["data"]
    assert result.status == WARN and result.message.startswith("1 prompt(s) are cut or dropped")


def test_a_tokenizer_without_chat_template_fails_the_template_check(run, tmp_path):
    build_tiny_tokenizer(chat_template=None).save_pretrained(tmp_path)
    results = doctor(run, f"model.tokenizer_path={tmp_path}")
    assert results["chat template"].status == FAIL
    assert "data.apply_chat_template=false" in results["chat template"].fix
    assert results["data"].status == WARN and "not checked" in results["data"].message
    assert results["reward functions"].status == OK  # rows still load and are scored


def test_a_tokenizer_larger_than_the_model_vocabulary_fails(run, tmp_path):
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<extra_0>", "<extra_1>"])
    tok.save_pretrained(tmp_path)
    result = doctor(run, f"model.tokenizer_path={tmp_path}")["tokenizer/model"]
    assert result.status == FAIL
    assert "the tokenizer has 102 tokens but the model's vocabulary has 100 rows" in result.message


def test_prompt_plus_response_over_the_context_fails(run):
    result = doctor(run, "rollout.max_new_tokens=300", "ppo.micro_batch_tokens=400",
                    "ppo.forward_micro_batch_tokens=400")["context length"]
    assert result.status == FAIL and "32 + 300 = 332 tokens" in result.message
    assert "max_position_embeddings = 256" in result.message


def test_a_reward_function_that_returns_nan_fails_with_its_name(run, tmp_path):
    (tmp_path / "my_reward.py").write_text("def bad(prompt, response, ground_truth, **row):\n"
                                           "    return float('nan')\n")
    result = doctor(run, f"reward.functions=[{tmp_path}/my_reward.py:bad]")["reward functions"]
    assert result.status == FAIL and "my_reward.py:bad" in result.message and "returned nan" in result.message


@pytest.mark.parametrize("broken, expected", [
    (dict(), "probe of 4 real prompts: scores ["),
    (dict(head="zero"), "the reward model gave the same score 0 to all 4 responses"),
    (dict(head="nan"), "the reward model produced non-finite scores for rows [0, 1, 2, 3]"),
    (dict(vocab_size=50), "outside the reward model's vocabulary (50 ids): the tokenizer is not the RM's own"),
    (dict(chat_template=None), "apply_chat_template=True but the reward model's tokenizer has no chat template"),
])
def test_the_reward_model_probe_names_the_cause(run, tmp_path, broken, expected):
    path = make_reward_model_dir(str(tmp_path), **broken)
    result = doctor(run, "reward_model.enable=true", f"reward_model.path={path}", "reward_model.max_length=128")
    rm = result["reward model"]
    assert expected in rm.message
    assert rm.status == (OK if not broken else FAIL)
    if broken.get("head"):
        assert "'<|im_start|>user\\n" in rm.details[0]  # the doctor shows what the RM saw
    if "chat_template" not in broken:  # the RM loaded: its scoring phase is in the memory estimate
        # the tiny RM is a llama classifier: auto scores it on phaserl's decoder, sized in tokens (8 × 128 at most)
        # the default 16384 fits and holds all 1024 a step can use: it fits, so the doctor suggests no change
        assert ("reward_model.micro_batch_tokens = 16384: uses at most 1024 tokens"
                in "\n".join(result["memory"].details))
        assert "reward_model.micro_batch_tokens=" not in result["memory"].details[-1]


def test_the_doctor_sizes_the_reward_model_by_the_key_its_engine_reads(run, tmp_path, monkeypatch):
    # 1_000_000 B free: 0.85 × 1_000_000 − 367_616 resident (350_720 B of actor + reference as below, + the RM's
    # 4_224 float32 params = 16_896 B) = 482_384 B for each phase. Responses per rank: 4 prompts × 2 = 8.
    monkeypatch.setattr("phaserl.doctor.checks.free_memory_bytes", lambda device: 1_000_000)
    rm = ["reward_model.enable=true", f"reward_model.path={make_reward_model_dir(str(tmp_path))}",
          "reward_model.max_length=128"]
    native = doctor(run, *rm, "reward_model.micro_batch_tokens=300")
    # floor(300 / 128) = 2 full-length inputs per forward, so ≤ ceil(8 / 2) = 4 forwards.
    assert ("≤ 4 reward-model forward(s) of ≤ 300 tokens (reward_model.micro_batch_tokens: 2 full-length input(s) "
            "of reward_model.max_length = 128 tokens each)") in native["batch sizes"].message
    assert "engine: phaserl's decoder (reward_model.engine = auto), right-padded" in native["reward model"].details[1]
    # hidden 16, MLP 32, float32: (2·16 + 2·32) × 4 = 384 B + the padded mask 128 × (1 + 4) = 640 B: 1 KB a token;
    # 482_384 // 1_024 = 471 tokens fit. 300 configured hold 2 inputs of 128 = 256 tokens: fine.
    assert native["memory"].status == OK
    # Regression: the line says in words what the configured size uses of what is free.
    assert ("reward_model.micro_batch_tokens = 300: uses at most 256 tokens, 256.0 KB of the 976.6 KB free (1.0 KB per "
            "token of a right-padded scoring forward); at most 471 would fit") in native["memory"].details
    # The default 16384 tokens would score all 8 responses at once: 8 × 128 × 1 KB = 1.0 MB, over 471 tokens.
    big = doctor(run, *rm)
    assert big["memory"].status == WARN
    assert big["memory"].message == ("reward_model.micro_batch_tokens = 16384 likely does not fit: its phase needs "
                                     "~1.0 MB on top of the weights; 471 fit")
    assert big["memory"].fix.startswith("reward_model.micro_batch_tokens=471  (reward_model.micro_batch_tokens: "
                                        "16384 does not fit, 471 does);")  # the sizes that fit are not listed
    # transformers: per sequence KV 2 × 1 layer × 2 heads × 8 × 4 B × 128 = 8 KB + 384 × 128 = 48 KB = 64 KB;
    # 482_384 // 65_536 = 7 of the 8 responses fit, and batch_size 16 would take all 8.
    hf = doctor(run, *rm, "reward_model.engine=transformers")
    assert "1 reward-model call(s) of ≤ 16 sequences (reward_model.batch_size)" in hf["batch sizes"].message
    assert hf["reward model"].details[1].startswith("engine: transformers (reward_model.engine = transformers)")
    assert hf["memory"].message == ("reward_model.batch_size = 16 likely does not fit: its phase needs ~512.0 KB on "
                                    "top of the weights; 7 fit")
    assert hf["memory"].fix.startswith("reward_model.batch_size=7  (reward_model.batch_size: 16 does not fit, 7 does);")


def test_little_free_memory_gives_a_warning_with_sizes_that_fit(run, monkeypatch):
    # 612_000 B free: 0.85 × 612_000 − 350_720 B of actor + reference weights and AdamW = 169_480 B, and a prompt
    # with its 2 samples needs 69_184 B (the model has the shape of SHAPE above): 2 prompts fit, not 4.
    monkeypatch.setattr("phaserl.doctor.checks.free_memory_bytes", lambda device: 612_000)
    result = doctor(run)["memory"]
    assert result.status == WARN and "rollout.batch_size = 4 likely does not fit" in result.message
    assert result.fix.startswith("rollout.batch_size=2 ppo.micro_batch_tokens=36  (rollout.batch_size: 4 does not "
                                 "fit, 2 does; ppo.micro_batch_tokens: not even one full-length item fits)")


def test_a_kept_rollout_engine_leaves_less_room_for_the_update(run, monkeypatch):
    monkeypatch.setattr("phaserl.doctor.checks.free_memory_bytes", lambda device: 2_000_000)
    keep = ["rollout.engine_keep_awake=true"]
    base, kept, capped = (doctor(run, *extra)["memory"] for extra in ([], keep + ["rollout.engine_max_slots=8"], keep))
    # The engine's KV pool: 8 slots x 64 tokens (36 rounded up to the engine's 64-token slots) x 256 B per token
    # (2 x 2 layers x 2 heads x 8 x 4 B) = 131,072 B, + 87,680 B of fused weight copies (the actor's 21,920
    # float32 params) = 218,752 B = 213.6 KB less for the update's activations at 4.2 KB per token: 216 -> 180
    # tokens (6 -> 5 sequences of 36) per micro-batch.
    assert "rollout.engine_keep_awake: 213.6 KB" in "\n".join(kept.details)
    assert "ppo.micro_batch_tokens=216" in base.details[-1] and "ppo.micro_batch_tokens=180" in kept.details[-1]
    # 512 slots (the default) would be 8.4 MB: the pool takes engine_memory_fraction 0.4 of the 2,000,000 B free
    # instead, 800,000 B, + 87,680 B = 866.9 KB.
    assert "rollout.engine_keep_awake: 866.9 KB" in "\n".join(capped.details)


def test_shared_paths_in_one_process(run, monkeypatch):
    local = doctor(run)["shared paths"]
    assert local.status == OK and local.message == "single process: nothing to share"
    # Relative paths are fine in one process, wherever the checkout lives (CI may clone under /tmp).
    relative = doctor(run, "trainer.checkpoint_path=runs/x/ckpt", "trainer.log_dir=runs/x")["shared paths"]
    assert relative.status == OK and "relative to" in relative.message
    planned = doctor(run, "trainer.checkpoint_path=runs/x/ckpt", "trainer.log_dir=runs/x",
                     world_size=2)["shared paths"]
    assert planned.status == WARN and "torchrun" in planned.fix


def test_load_doctor_config_keeps_per_field_checks_but_not_cross_field_rules():
    cfg = load_doctor_config(None, ["ppo.num_mini_batches=3"])  # 128 / 3: validate would raise
    assert cfg.ppo.num_mini_batches == 3
    with pytest.raises(ConfigError, match="ppo.mini_batch_sise"):
        load_doctor_config(None, ["ppo.mini_batch_sise=3"])


def test_a_missing_model_fails_once_and_skips_what_needs_it(run, tmp_path):
    results = doctor(run, f"model.path={tmp_path / 'nothing'}")
    assert results["model"].status == FAIL and "does not exist" in results["model"].message
    for name in ("tokenizer/model", "context length", "reference frozen", "memory"):
        assert results[name].status == WARN and results[name].message.startswith("skipped: needs the")


def test_in_bfloat16_the_mismatch_is_read_against_the_models_own_precision_noise(run):
    """bf16 weights: the probe also runs a float32 copy of them; engine vs trainer is rounding, within ~1× the
    trainer's own distance from float32 (on the CPU; NOISE_WARN leaves 3×)."""
    result = doctor(run, "model.dtype=bfloat16")["rollout/training mismatch"]
    assert result.status == OK, result
    (line,) = result.details
    noise, times = re.match(r"precision noise: the trainer is (\S+) .* the mismatch is (\S+)× that", line).groups()
    assert float(noise) > 0 and float(times) < 3.0, line


def test_a_path_difference_is_told_apart_from_precision_noise(run, monkeypatch):
    import phaserl.roles.mismatch_probe as check

    right = check.batch_logprobs  # the trainer (and its float32 copy) ignore the temperature: not rounding
    monkeypatch.setattr(check, "batch_logprobs", lambda *a, **kw: right(*a, **{**kw, "temperature": 1.0}))
    result = doctor(run, "model.dtype=bfloat16", "rollout.temperature=0.7")["rollout/training mismatch"]
    assert result.status == WARN and "do not compute the same thing" in result.message, result
    assert "rollout.engine=hf" in result.fix


def test_the_float32_copy_is_skipped_where_it_would_not_fit():
    from phaserl.roles.mismatch_probe import precision_noise

    model = torch.nn.Linear(256, 256).to(torch.bfloat16)
    noise, note = precision_noise(model, None, None, {}, free_bytes=256 * 256 * 4)
    assert noise is None and "float32 copy (0.0 GiB) would take over 50% of the free memory" in note
    assert precision_noise(torch.nn.Linear(4, 4), None, None, {}, free_bytes=1 << 30) == (None, "")
