"""benchmarks/step_probes.micro_batch_sweep: the update at several micro-batch sizes in one process, and the host's
cost per micro-batch fitted from them (the slope of update seconds over micro-batches)."""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))


@dataclasses.dataclass(frozen=True)
class _Run:
    train_tokens: int
    mini_batch_per_rank: int = 512
    responses_per_step: int = 512
    epochs: int = 1


class _Trainer:
    """An update that takes 1.2 s of device work plus 0.05 s of host work per micro-batch of 384-token sequences."""

    world_size = 1

    def __init__(self):
        self.run, self.step_num, self.seen = _Run(12_288), 0, []

    def train_step(self) -> dict:
        micro = -(-512 // (self.run.train_tokens // 384))
        self.seen.append(self.run.train_tokens)
        return {"timing_s/update": 1.2 + 0.05 * micro}


def test_the_sweep_recovers_the_per_micro_batch_cost_and_puts_the_micro_batch_back():
    import step_probes

    lines, trainer = [], _Trainer()
    step_probes.micro_batch_sweep(trainer, [8064, 12_288, 32_640], 2, 384, lambda **r: lines.append(r))
    sweep = [r for r in lines if r["measure"] == "micro_batch_sweep"]
    # 512 sequences: 21, 32 and 85 per micro-batch -> 25, 16 and 7 micro-batches (ceil)
    assert [(r["micro_batch_tokens"], r["micro_batches"], r["update_s"]) for r in sweep] == [
        (8064, 25, 2.45), (12_288, 16, 2.0), (32_640, 7, 1.55)]
    fit = next(r for r in lines if r["measure"] == "host_cost_per_micro_batch")
    assert (fit["seconds"], fit["intercept_s"]) == (0.05, 1.2)
    assert trainer.seen == [8064] * 3 + [12_288] * 3 + [32_640] * 3  # one untimed step, then 2 timed, per size
    assert trainer.run.train_tokens == 12_288 and trainer.step_num == 9
