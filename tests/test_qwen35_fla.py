"""flash-linear-attention (fla) for Qwen3.5's Gated DeltaNet layers: trusted only after its rule agrees with ours,
its forward and backward judged apart (fla-core 0.6.0 refuses its backward on Hopper below Triton 3.7.1, fla #640),
a backward-less fla serving the reference's pass only, and the doctor's warning when the transformers path would
call such an fla. CPU tests use a stand-in fla over our torch rule; the GPU test uses the real one where it imports."""
import pytest
import torch
import transformers

from _qwen35_pair import TINY, Qwen3_5TextConfig, make_pair, randomize
from _qwen35_pair import fake_fla as _fake_fla
from phaserl.models import CausalLM

torch.set_num_threads(1)
pytestmark = pytest.mark.skipif(Qwen3_5TextConfig is None, reason="this transformers has no Qwen3.5")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory)


@pytest.mark.parametrize("fake, trusted", [(_fake_fla(), True), (_fake_fla(wrong=True), False),
                                           (_fake_fla(broken=True), False)])
def test_fla_is_used_only_after_it_agrees_with_the_torch_rule(monkeypatch, fake, trusted):
    from phaserl.models import linear_attention

    monkeypatch.setattr(linear_attention, "_fla_rule", lambda: fake)
    assert all(linear_attention._fla_probe(torch.device("cpu"))) is trusted


@pytest.mark.parametrize("fake, forward, backward", [
    (_fake_fla(), True, True), (_fake_fla(no_backward=True), True, False), (_fake_fla(wrong=True), False, False),
    (_fake_fla(broken=True), False, False), (_fake_fla(wrong=True, no_backward=True), False, False)])
def test_fla_probe_trusts_the_forward_and_the_backward_separately(monkeypatch, fake, forward, backward):
    from phaserl.models import linear_attention

    monkeypatch.setattr(linear_attention, "_fla_rule", lambda: fake)
    assert linear_attention._fla_probe(torch.device("cpu")) == (forward, backward)
    with torch.inference_mode():  # the first probe may come from the reference's pass: the same answer
        assert linear_attention._fla_probe(torch.device("cpu")) == (forward, backward)


def test_an_fla_without_backward_serves_the_reference_pass_only(pair, monkeypatch):
    # fla-core 0.6.0 on the H200 (Triton 3.6): forward fine, backward refused. The reference's pass takes its
    # kernels; every other pass, with or without gradients (the old log-probs), runs the torch rule, so the PPO
    # ratio compares one rule with itself.
    from phaserl.models import linear_attention

    _, ours, _ = pair
    calls = []
    monkeypatch.setattr(linear_attention, "_fla_rule", lambda: _fake_fla(no_backward=True, calls=calls))
    monkeypatch.setattr(linear_attention, "FLA_DEVICES", ("cpu",))
    monkeypatch.setattr(linear_attention, "_FLA_PROBED", {})
    ids = torch.randint(0, 96, (2, 70), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        old_logprobs = ours(ids).float()
    probe_calls = 2  # _fla_probe: its forward, then its backward
    assert len(calls) == probe_calls and linear_attention._FLA_PROBED[torch.device("cpu")] == (True, False)
    with torch.no_grad(), linear_attention.reference_pass():
        reference = ours(ids).float()
    layers = sum(ours.config.is_linear(i) for i in range(ours.config.num_hidden_layers))
    assert calls[probe_calls:] == [False] * layers  # every linear layer of the reference's pass called fla
    with linear_attention.reference_pass():
        update = ours(ids)  # gradients asked for: never fla's refused backward
    update.float().square().mean().backward()
    assert len(calls) == probe_calls + layers
    torch.testing.assert_close(update.detach().float(), old_logprobs)
    gap = (reference - old_logprobs).abs().max()  # _fla_chunk hands fla bf16 inputs
    assert 0 < gap < 0.05 * old_logprobs.abs().max()


def test_the_reference_role_runs_its_forward_as_the_reference_pass(pair, monkeypatch):
    import copy

    from phaserl.models import linear_attention
    from phaserl.roles import reference

    seen = []
    monkeypatch.setattr(reference, "batch_logprobs", lambda *a, **k: seen.append(linear_attention._REFERENCE_PASS[0])
                        or torch.zeros(1, 1))
    reference.ReferencePolicy(copy.deepcopy(pair[1])).compute_logprobs(None, temperature=1.0, token_budget=8)
    assert seen == [True] and linear_attention._REFERENCE_PASS[0] is False


def test_the_doctor_warns_when_the_transformers_path_would_call_an_fla_without_backward(tmp_path, monkeypatch):
    # Seen on the H200 (transformers 5.17, fla-core 0.6.0, Triton 3.6): transformers' Qwen3.5 layers called fla's
    # chunk_gated_delta_rule, whose backward refuses on Hopper below Triton 3.7.1, and the first update stopped.
    # The doctor's model check now says so before training, with the fixes; the native decoder is not affected.
    from phaserl.doctor import load_doctor_config
    from phaserl.doctor.checks import Context, _transformers_delta_rule_trouble, check_model
    from phaserl.doctor.report import OK, WARN
    from phaserl.models import linear_attention

    hf = randomize(transformers.AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**TINY)))
    hf.save_pretrained(tmp_path / "model")
    from phaserl.world.tokenizer import save_tokenizer
    save_tokenizer(str(tmp_path / "model"))
    monkeypatch.setattr(linear_attention, "FLA_DEVICES", ("cpu",))
    monkeypatch.setattr(linear_attention, "_FLA_PROBED", {})
    monkeypatch.setattr(linear_attention, "_fla_rule", lambda: _fake_fla(no_backward=True))
    cpu = torch.device("cpu")

    def doctor_model(implementation):
        cfg = load_doctor_config(None, [f"model.path={tmp_path / 'model'}", f"model.implementation={implementation}",
                                        "trainer.device=cpu", "model.dtype=float32"])
        ctx = Context(cfg=cfg, world_size=1)
        ctx.device = cpu
        return check_model(ctx), ctx.policy

    result, policy = doctor_model("transformers")
    assert result.status == WARN, result
    assert "backward refuses" in result.message and "model.implementation=native" in result.fix
    result, policy = doctor_model("native")
    assert result.status == OK and _transformers_delta_rule_trouble(policy, cpu) is None
    monkeypatch.setattr(linear_attention, "_FLA_PROBED", {})
    monkeypatch.setattr(linear_attention, "_fla_rule", lambda: _fake_fla())  # an fla whose backward runs
    assert doctor_model("transformers")[0].status == OK
    monkeypatch.setattr(linear_attention, "_fla_rule", lambda: None)  # no fla: transformers' torch fallback
    monkeypatch.setattr(linear_attention, "_FLA_PROBED", {})
    assert doctor_model("transformers")[0].status == OK


@pytest.mark.gpu
def test_gpu_fla_chunk_rule_equals_the_torch_rule(pair, monkeypatch):
    from phaserl.models import linear_attention

    if linear_attention._fla_rule() is None:
        pytest.skip("flash-linear-attention (fla) does not import here")
    if not linear_attention._fla_probe(torch.device("cuda"))[0]:
        pytest.skip("fla imports but its forward disagrees or fails here (logged): both sides would run the torch rule")
    _, ours, _ = pair
    model = CausalLM(ours.config).to("cuda")
    model.load_state_dict(ours.state_dict())
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, 96, (2, 150), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad(), linear_attention.reference_pass():  # where fla's backward refuses, only this pass takes it
        with_fla = model(ids).float()
        monkeypatch.setattr(linear_attention, "USE_FLA", False)
        torch_rule = model(ids).float()
    assert (with_fla - torch_rule).abs().max() < 0.05 * torch_rule.abs().max()
