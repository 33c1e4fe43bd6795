"""Preference pairs from the tiny arithmetic world: the correct sum is chosen, a near miss rejected.

A pair is a verl-style preference row (`prompt` as chat messages, `chosen_response`,
`rejected_response`, plus `data_source` and `extra_info.rejected_kind`). For a third of the pairs the
rejected answer is the sum of another random problem: shaped exactly like a right answer, it forces
the RM to read the question (without them, an earlier RM learned "three digits starting with 1 look right"
and PPO exploited it). The rest are near misses: where the problem carries, half get the sloppy
teacher's carry-free sum (`57+68=` -> `15`, the warm-started policy's own mistake); otherwise off by
one or ten, two digits swapped, or a digit dropped.

RM training pairs come from the world's `sft` split and held-out pairs from its `val` split, so the RM
never sees the problems the RL run validates on, nor the RL training prompts (`train` split).
Not here: the tiny world itself (phaserl.world), training the RM (train.py).
"""
from __future__ import annotations

import os
import random

from phaserl.data import write_records
from phaserl.world.task import DATA_SOURCE, OPERAND_MAX, Problem, carry_free_sum, make_problems, to_record

NEAR_MISS_KINDS = ("dropped_carry", "off_by_one", "off_by_ten", "swapped_digits", "dropped_digit")
REJECTED_KINDS = ("other_sum",) + NEAR_MISS_KINDS
OTHER_SUM_SHARE = 1 / 3  # share of pairs whose rejected answer is another problem's sum
DROPPED_CARRY_SHARE = 0.5  # of the other problems that carry, this share gets the teacher's carry-free sum
RM_TRAIN_SPLIT, RM_VAL_SPLIT = "sft", "val"


def near_misses(a: int, b: int) -> dict[str, int]:
    """One wrong answer of each kind for a+b; a kind is missing when it would equal the truth.

    The direction of an off-by-one/ten miss is a fixed function of the problem (so pairs are
    reproducible and both directions occur): +1 for an odd or zero sum, else -1; +10 for a sum under 10
    or an odd 7a+b, else -10. `dropped_digit` drops the first digit when a+b is not a multiple of 3.
    """
    truth, text = a + b, str(a + b)
    out = {}
    if carry_free_sum(a, b) != truth:
        out["dropped_carry"] = carry_free_sum(a, b)
    out["off_by_one"] = truth + 1 if truth == 0 or (a + b) % 2 else truth - 1
    out["off_by_ten"] = truth + 10 if truth < 10 or (a * 7 + b) % 2 else truth - 10
    if len(text) >= 2 and text[-1] != text[-2] and not (len(text) == 2 and text[-1] == "0"):
        out["swapped_digits"] = int(text[:-2] + text[-1] + text[-2])
    if len(text) >= 2:
        out["dropped_digit"] = int(text[1:]) if (a + b) % 3 else int(text[:-1])
    return {kind: wrong for kind, wrong in out.items() if wrong != truth}


def preference_record(problem: Problem, rejected: str, kind: str, index: int, split: str) -> dict:
    record = to_record(problem, index, split)
    return {"prompt": record["prompt"], "chosen_response": problem.answer, "rejected_response": rejected,
            "data_source": DATA_SOURCE, "extra_info": {**record["extra_info"], "rejected_kind": kind}}


def other_sum(truth: int, rng: random.Random) -> int:
    """The sum of another random problem (a different number): a wrong answer shaped exactly like a right one."""
    while True:
        wrong = rng.randint(0, OPERAND_MAX) + rng.randint(0, OPERAND_MAX)
        if wrong != truth:
            return wrong


def make_tiny_preference_records(split: str, n: int, seed: int, *, other_sum_share: float = OTHER_SUM_SHARE,
                                 dropped_carry_share: float = DROPPED_CARRY_SHARE) -> list[dict]:
    """`n` preference rows over `n` distinct problems of `split`; the same arguments give the same rows."""
    rng = random.Random(f"tiny-prefs:{split}:{seed}")
    records = []
    for i, problem in enumerate(make_problems(split, n, seed)):
        a, b = (int(x) for x in problem.question.rstrip("=").split("+"))
        misses = near_misses(a, b)
        if rng.random() < other_sum_share:
            kind, wrong = "other_sum", other_sum(a + b, rng)
        elif "dropped_carry" in misses and rng.random() < dropped_carry_share:
            kind, wrong = "dropped_carry", misses["dropped_carry"]
        else:
            kind = rng.choice(sorted(k for k in misses if k != "dropped_carry"))
            wrong = misses[kind]
        records.append(preference_record(problem, str(wrong), kind, i, split))
    return records


def write_tiny_preference_files(out_dir: str, *, n_train: int = 2000, n_val: int = 400,
                                seed: int = 0) -> tuple[str, str]:
    """Write train.jsonl (from the sft split) and val.jsonl (from the val split) under `out_dir`."""
    paths = []
    for name, split, n in (("train", RM_TRAIN_SPLIT, n_train), ("val", RM_VAL_SPLIT, n_val)):
        path = os.path.join(out_dir, f"{name}.jsonl")
        write_records(path, make_tiny_preference_records(split, n, seed))
        paths.append(path)
    return paths[0], paths[1]
