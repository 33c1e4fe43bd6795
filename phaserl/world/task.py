"""The tiny world's task: two-digit addition with an exact, verifiable answer, and a sloppy teacher.

A problem is `a+b=` with a, b in [0, 99], each written with two digits (`07+68=`), so that every
digit sits at a fixed position and a tiny model learns the task quickly; the answer is the sum in
plain decimal (`07+68=` -> `75`, `57+68=` -> `125`). The space holds 100 * 100 = 10,000 problems.
Each problem belongs to exactly one split, chosen by a hash of its text, so the SFT warm-start, the
RL training prompts and the held-out validation prompts never share a problem:

    split   share of the space   problems
    sft          60 %              5,948
    train        30 %              3,091
    val          10 %                961

The SFT answers come from a *sloppy teacher*: on a problem whose columns carry, it forgets every
carry with probability SLOPPY_RATE and writes the column sums mod 10 instead (`57+68=` -> `15`).
A model that imitates it answers the ~30 % of problems without a carry and, greedily, gets almost
every carry problem wrong, while still sampling the right answer now and then (about one time in
five for the committed model). That is the situation RL from a verifiable reward is for: the
exact-match reward (`tiny_exact`) teaches the model to carry, and greedy held-out accuracy goes from
about 0.35 to above 0.8 within a few dozen GRPO steps.

This module only makes problems and verl-schema records; the reward rule lives in
`phaserl.rewards.rules`, the tokenizer in `tokenizer.py`, files on disk in `build.py`.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import lru_cache

from phaserl.errors import ConfigError

DATA_SOURCE = "tiny_arith"
REWARD_RULE = "tiny_exact"
OPERAND_MAX = 99  # operands are drawn from [0, OPERAND_MAX]
SPLITS = ("sft", "train", "val")
SLOPPY_RATE = 0.7  # chance that the teacher drops the carries of a problem that has any
# A problem's split is bucket = sha256(question) mod 100, then: [0, 10) val, [10, 40) train, rest sft.
_VAL_BUCKETS, _TRAIN_BUCKETS = range(0, 10), range(10, 40)


@dataclass(frozen=True)
class Problem:
    question: str  # e.g. "07+45="
    answer: str  # e.g. "68": the exact text the model should write before EOS


def carry_free_sum(a: int, b: int) -> int:
    """The sloppy teacher's sum: each decimal column added mod 10, carries dropped (57+68 -> 15)."""
    total, place = 0, 1
    while a or b:
        total += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return total


def question_of(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="


def split_of(question: str) -> str:
    """The split a question belongs to: a fixed function of its text, independent of any seed."""
    bucket = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % 100
    return "val" if bucket in _VAL_BUCKETS else "train" if bucket in _TRAIN_BUCKETS else "sft"


@lru_cache(maxsize=None)
def _operands(split: str) -> tuple[tuple[int, int], ...]:
    """Every (a, b) of `split`, in a fixed order."""
    pairs = ((a, b) for a in range(OPERAND_MAX + 1) for b in range(OPERAND_MAX + 1))
    return tuple((a, b) for a, b in pairs if split_of(question_of(a, b)) == split)


def pool_size(split: str) -> int:
    _check_split(split)
    return len(_operands(split))


def make_problems(split: str, n: int, seed: int) -> list[Problem]:
    """`n` distinct problems of `split` with their true answers; the same (split, n, seed) gives the same list."""
    return [Problem(question_of(a, b), str(a + b)) for a, b in _sample(split, n, seed)]


def make_teacher_problems(n: int, seed: int, sloppy_rate: float = SLOPPY_RATE) -> list[Problem]:
    """`n` distinct problems of the sft split answered by the sloppy teacher (see the module docstring)."""
    if not 0.0 <= sloppy_rate <= 1.0:
        raise ConfigError(f"make_teacher_problems: sloppy_rate={sloppy_rate} is not a probability; use 0..1")
    rng = random.Random(f"teacher:{seed}")
    problems = []
    for a, b in _sample("sft", n, seed):
        sloppy = carry_free_sum(a, b)
        answer = sloppy if sloppy != a + b and rng.random() < sloppy_rate else a + b
        problems.append(Problem(question_of(a, b), str(answer)))
    return problems


def to_record(problem: Problem, index: int, split: str) -> dict:
    """One verl-schema prompt row (what `data.train_files` JSONL/parquet rows look like)."""
    return {
        "prompt": [{"role": "user", "content": problem.question}],
        "data_source": DATA_SOURCE,
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"split": split, "index": index},
    }


def _sample(split: str, n: int, seed: int) -> list[tuple[int, int]]:
    _check_split(split)
    pool = _operands(split)
    if not 1 <= n <= len(pool):
        raise ConfigError(f"tiny world: n={n} problems asked of split '{split}', which holds {len(pool)}; "
                          f"ask for between 1 and {len(pool)}")
    # A string seed is hashed by `random` itself (sha512), so the draw is the same in every process.
    return random.Random(f"{split}:{seed}").sample(pool, n)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"unknown tiny-world split '{split}'; use one of {', '.join(SPLITS)}")
