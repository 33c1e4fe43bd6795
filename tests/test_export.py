"""`phaserl export CKPT OUT_DIR [--critic]`: a checkpoint becomes a Hugging Face directory that transformers
loads with the trained weights (bit for bit) and the logits/values our models compute; trainer.export_hf
writes one into every step_N/hf/; a non-empty OUT_DIR is refused unless overwrite."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

from _tiny_tokenizer import build_tiny_tokenizer
from phaserl.checkpoint import Checkpointer, TrainingState, cli_export, export_checkpoint
from phaserl.errors import ConfigError
from phaserl.models import CausalLM, DecoderConfig, ValueModel
from phaserl.roles.optim import Optimizer, OptimSettings

IDS = torch.tensor([[5, 9, 14, 30, 2, 7], [40, 41, 42, 1, 3, 3]])   # [B, T]


def _role(model):
    return SimpleNamespace(model=model, optimizer=Optimizer(model.parameters(), OptimSettings(lr=1e-2)))


def _trained(role) -> None:
    """One AdamW step so that the weights differ from any initialization."""
    out = role.model(IDS)                                             # [B, T, H] or values [B, T]
    out.float().square().mean().backward()
    role.optimizer.opt.step()
    role.optimizer.opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="qwen2", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=False, attention_bias=True, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    actor, critic = _role(CausalLM(cfg)), _role(ValueModel(CausalLM(cfg)))
    _trained(actor)
    _trained(critic)
    ckpt = Checkpointer(root=str(root / "ckpt"), keep=3, resume_mode="auto", export_hf=True)
    path = ckpt.save(TrainingState(step=5, roles={"actor": actor, "critic": critic}, tokenizer=tokenizer))
    return SimpleNamespace(root=root, path=path, actor=actor.model, critic=critic.model, tokenizer=tokenizer)


def _assert_same_weights(model, directory) -> None:
    from safetensors.torch import load_file

    exported = load_file(os.path.join(directory, "model.safetensors"))
    assert exported.keys() == model.state_dict().keys()
    for name, value in model.state_dict().items():
        assert torch.equal(exported[name], value), name


def test_actor_export_loads_in_transformers_with_the_same_logits(saved, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_checkpoint(saved.path, str(tmp_path / "actor"))
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(os.listdir(out))
    _assert_same_weights(saved.actor, out)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        expected = saved.actor.logits(saved.actor(IDS))                 # [B, T, V]
        torch.testing.assert_close(hf(input_ids=IDS).logits, expected, atol=1e-5, rtol=1e-5)
    assert AutoTokenizer.from_pretrained(out).encode("3+4") == saved.tokenizer.encode("3+4")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == saved.tokenizer.eos_token_id


def test_critic_export_is_a_sequence_classification_model_with_the_same_values(saved, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = export_checkpoint(saved.path, str(tmp_path / "critic"), critic=True)
    _assert_same_weights(saved.critic, out)
    hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == 1
    with torch.no_grad():
        values = saved.critic(IDS[:1])                                # [1, T]
        torch.testing.assert_close(hf(input_ids=IDS[:1]).logits[:, 0], values[:, -1], atol=1e-5, rtol=1e-5)


def test_export_hf_writes_the_actor_into_every_checkpoint(saved):
    _assert_same_weights(saved.actor, os.path.join(saved.path, "hf"))
    assert os.path.isfile(os.path.join(saved.path, "hf", "tokenizer.json"))


def test_a_checkpoint_path_root_exports_its_newest_complete_step(saved, tmp_path):
    out = export_checkpoint(str(saved.root / "ckpt"), str(tmp_path / "newest"))
    _assert_same_weights(saved.actor, out)


def test_a_non_empty_out_dir_is_refused_unless_overwrite(saved, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not empty; pass --overwrite"):
        export_checkpoint(saved.path, str(out))
    assert (out / "notes.txt").read_text() == "mine"
    export_checkpoint(saved.path, str(out), overwrite=True)
    assert not (out / "notes.txt").exists()
    _assert_same_weights(saved.actor, out)
    (tmp_path / "empty").mkdir()
    export_checkpoint(saved.path, str(tmp_path / "empty"))            # an empty directory is fine


def test_an_incomplete_checkpoint_is_refused(saved, tmp_path):
    half = tmp_path / "step_7"
    half.mkdir()
    with pytest.raises(ConfigError, match="step_7' is incomplete: no metadata.json"):
        export_checkpoint(str(half), str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="does not exist"):
        export_checkpoint(str(tmp_path / "nowhere"), str(tmp_path / "out"))


def test_cli_export(saved, tmp_path, capsys):
    assert cli_export([saved.path, str(tmp_path / "cli"), "--critic"]) == 0
    assert "exported to" in capsys.readouterr().out
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["num_labels"] == 1


def test_a_model_on_the_transformers_fallback_path_exports_too(tmp_path):
    """Architectures we do not implement natively (here GPT-2) run as HFCausalLM; export rebuilds them."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from phaserl.models.hf_fallback import HFCausalLM

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=1)
    role = _role(HFCausalLM(GPT2LMHeadModel(config)))
    _trained(role)
    ckpt = Checkpointer(root=str(tmp_path / "ckpt"), keep=1, resume_mode="auto", export_hf=False)
    path = ckpt.save(TrainingState(step=1, roles={"actor": role}))
    assert json.loads(open(os.path.join(path, "architecture", "actor.json")).read())["kind"] == "transformers"
    hf = AutoModelForCausalLM.from_pretrained(export_checkpoint(path, str(tmp_path / "hf"))).eval()
    role.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=IDS).logits, role.model.logits(role.model(IDS)), atol=1e-6, rtol=1e-6)


def test_critic_export_of_a_run_without_critic_is_refused(tmp_path):
    torch.manual_seed(0)
    cfg = DecoderConfig(model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    ckpt = Checkpointer(root=str(tmp_path / "ckpt"), keep=1, resume_mode="auto", export_hf=False)
    path = ckpt.save(TrainingState(step=1, roles={"actor": _role(CausalLM(cfg))}))
    with pytest.raises(ConfigError, match=r"has no critic \(roles saved: \['actor'\]\); drop --critic"):
        export_checkpoint(path, str(tmp_path / "out"), critic=True)
