"""Exact resume for the newer families: a run of three steps equals one step, a checkpoint, and a fresh
process-like trainer that resumes it for two more, bit for bit, for Qwen3.5 (recurrent layers), Qwen3-MoE (with
routing replay and multi-turn episodes) and Gemma 4 (per-layer head widths, E2B/E4B's per-layer inputs and shared
keys/values), with LoRA on one of them. The
kill -9 tests (test_resume_kill.py, test_agents_resume.py) run the dense decoder; this pins the same floor for
the families added since, in-process."""
import os

import pytest
import torch
import transformers

from _tiny_run import make_prompt_files
from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.config import load_config
from phaserl.trainer import RLTrainer
from test_model_coverage import tiny_config

pytestmark = pytest.mark.slow  # nine short trainer runs

HERE = os.path.dirname(os.path.abspath(__file__))
REWARD = os.path.join(HERE, "_varied.py")

CASES = {
    "qwen3_5_text": ["actor.lora.rank=4"],
    "qwen3_moe": ["actor.routing_replay=true", f"agent.env={REWARD}:Varied", "agent.max_turns=2",
                  "agent.max_episode_tokens=96"],
    "gemma4_text": [],
}


@pytest.mark.parametrize("model_type", list(CASES))
def test_three_steps_equal_one_step_a_checkpoint_and_two_resumed(tmp_path, model_type):
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(model_type, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    train, val = make_prompt_files(str(tmp_path), n_train=8, n_val=2)

    def trainer(name: str, steps: int) -> RLTrainer:
        return RLTrainer.from_config(load_config(None, [
            f"model.path={tmp_path / 'model'}", f"data.train_files=[{train}]", f"data.val_files=[{val}]",
            "data.max_prompt_length=32", "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.n=2",
            "rollout.batch_size=2", f"trainer.total_steps={steps}", "trainer.device=cpu", "trainer.loggers=[]",
            "trainer.save_interval=1", "actor.optim.lr=1e-2", f"reward.functions=[{{name: {REWARD}:compute_score}}]",
            f"trainer.log_dir={tmp_path / name}", f"trainer.checkpoint_path={tmp_path / name / 'ckpt'}",
            "ppo.micro_batch_tokens=128", "ppo.forward_micro_batch_tokens=256", *CASES[model_type]]))

    straight = trainer("straight", 3)
    straight.fit()
    first = trainer("resumed", 1)
    first.fit()
    after_one = {k: v.clone() for k, v in first.actor.model.state_dict().items()}
    resumed = trainer("resumed", 3)
    resumed.fit()
    assert resumed.step_num == 3
    want, got = straight.actor.model.state_dict(), resumed.actor.model.state_dict()
    assert any(not torch.equal(want[k], after_one[k]) for k in want)  # the later steps trained something
    for k in want:
        assert torch.equal(want[k], got[k]), k
