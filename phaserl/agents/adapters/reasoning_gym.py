"""reasoning-gym datasets as phaserl training rows, a rule reward and a retry environment.

reasoning-gym (`pip install reasoning-gym`) generates its tasks procedurally from (name, seed, size,
config), so a row here stores where its task came from, not a copy of it, and the scorer rebuilds
the exact entry and asks the dataset's own `score_answer`:

    records("basic_arithmetic", size=1000, seed=0)  -> verl-schema rows:
        {"prompt": [{"role": "user", "content": question + instruction}], "data_source": "reasoning_gym/<name>",
         "reward_model": {"ground_truth": answer},
         "extra_info": {"reasoning_gym": {dataset, seed, size, index, config (JSON text)}}}
    score(prompt, response, ground_truth, extra_info=...)  -> float in [0, 1]    (a reward.functions entry)
    ReasoningGymEnvironment(attempts=3)   -> a wrong answer gets "incorrect, try again" until attempts run out

Write a file for `data.train_files` with
    python -m phaserl.agents.adapters.reasoning_gym basic_arithmetic --size 2000 --seed 0 --out train.jsonl

The answer is read from the response by `answer_format`: "tag" (the last <answer>...</answer>, the
instruction asks for it), "boxed" (the last \\boxed{...}) or "raw" (the whole response, stripped).
Not here: reasoning-gym's curricula and composite datasets' weighting (pass them as `config`).
"""
from __future__ import annotations

import argparse
import functools
import json
import re
from typing import Optional

from phaserl.agents.env import Environment, StepResult

INSTRUCTION = "\n\nGive your final answer inside <answer></answer>."
ANSWER_FORMATS = ("tag", "boxed", "raw")


def _rg():
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError("the reasoning-gym adapter needs the package: pip install reasoning-gym "
                          "(or pip install \"phaserl[agents]\")") from exc
    return reasoning_gym


def records(name: str, *, size: int, seed: int = 0, config: Optional[dict] = None,
            instruction: str = INSTRUCTION) -> list:
    """`size` verl-schema rows of dataset `name` (see the module docstring)."""
    config_json = json.dumps(dict(config or {}), sort_keys=True)  # a string: parquet cannot store an empty struct
    dataset = _dataset(name, seed, size, config_json)
    rows = []
    for index in range(size):
        entry = dataset[index]
        rows.append({"prompt": [{"role": "user", "content": entry["question"] + instruction}],
                     "data_source": f"reasoning_gym/{name}",
                     "reward_model": {"ground_truth": str(entry["answer"])},
                     "extra_info": {"reasoning_gym": {"dataset": name, "seed": seed, "size": size, "index": index,
                                                      "config": config_json}}})
    return rows


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, size: int, config_json: str):
    rg = _rg()
    try:
        return rg.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"reasoning-gym dataset {name!r} (seed={seed}, size={size}, config={config_json}) could "
                         f"not be created: {exc}") from exc


def entry_of(extra_info, *, where: str = "row") -> tuple:
    """(dataset, entry) for a row's extra_info written by `records`."""
    spec = (extra_info or {}).get("reasoning_gym") if isinstance(extra_info, dict) else None
    keys = ("dataset", "seed", "size", "index")
    if not isinstance(spec, dict) or any(k not in spec for k in keys):
        raise ValueError(f"{where}: extra_info.reasoning_gym with {', '.join(keys)} is missing; make the rows "
                         "with phaserl.agents.adapters.reasoning_gym.records (or its command line)")
    config = spec.get("config") or "{}"
    config_json = config if isinstance(config, str) else json.dumps(config, sort_keys=True)
    dataset = _dataset(spec["dataset"], int(spec["seed"]), int(spec["size"]), config_json)
    return dataset, dataset[int(spec["index"])]


def extract(response: str, answer_format: str) -> Optional[str]:
    if answer_format == "raw":
        return response.strip()
    if answer_format == "tag":
        found = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
        return found[-1].strip() if found else None
    if answer_format == "boxed":
        from phaserl.rewards.rules import last_boxed

        return last_boxed(response)
    raise ValueError(f"answer_format={answer_format!r}; choose one of {ANSWER_FORMATS}")


def score(prompt, response: str, ground_truth, extra_info=None, answer_format: str = "tag", **row) -> float:
    """reasoning-gym's own score_answer for the row's entry; 0 when no answer can be read."""
    dataset, entry = entry_of(extra_info, where=f"reasoning_gym.score (data_source {row.get('data_source')!r})")
    answer = extract(response, answer_format)
    return float(dataset.score_answer(answer, entry)) if answer is not None else 0.0


class ReasoningGymEnvironment(Environment):
    """Answer a reasoning-gym task in up to `attempts` turns; each wrong answer is told so.

    The reward is the dataset's score of the last answer (times `decay ** (attempt - 1)`, so that a
    first-try success is worth most). A turn without a readable answer counts as a wrong attempt.
    """

    def __init__(self, attempts: int = 1, answer_format: str = "tag", decay: float = 1.0,
                 feedback: str = ("Your answer {answer} is incorrect. Try again; "
                                  "give the answer inside <answer></answer>.")):
        if attempts < 1:
            raise ValueError(f"ReasoningGymEnvironment: attempts={attempts} must be >= 1")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"ReasoningGymEnvironment: answer_format={answer_format!r}; "
                             f"choose one of {ANSWER_FORMATS}")
        if not 0 < decay <= 1:
            raise ValueError(f"ReasoningGymEnvironment: decay={decay} must be in (0, 1]")
        self.attempts, self.answer_format, self.decay, self.feedback = attempts, answer_format, decay, feedback
        self.dataset = self.entry = None
        self.tries = 0

    def reset(self, row, *, seed: int):
        extra = row.get("extra_info") if isinstance(row, dict) else getattr(row, "extra_info", None)
        self.dataset, self.entry = entry_of(extra, where=f"ReasoningGymEnvironment row {_source(row)}")
        self.tries = 0
        return ""

    def step(self, action: str) -> StepResult:
        self.tries += 1
        answer = extract(action, self.answer_format)
        value = float(self.dataset.score_answer(answer, self.entry)) if answer is not None else 0.0
        metrics = {"rg_attempts": float(self.tries), "rg_score": value}
        if value >= 1.0 or self.tries >= self.attempts:
            return StepResult(None, value * self.decay ** (self.tries - 1), True, {"metrics": metrics})
        text = self.feedback.format(answer=answer if answer is not None else "(none found)")
        return StepResult([{"role": "user", "content": text}], 0.0, False, {"metrics": metrics})


def _source(row) -> str:
    value = row.get("source", row.get("index")) if isinstance(row, dict) else getattr(row, "source", None)
    return repr(value)


def main(argv: Optional[list] = None) -> None:
    from phaserl.data.files import write_records

    parser = argparse.ArgumentParser(prog="python -m phaserl.agents.adapters.reasoning_gym",
                                     description="Write reasoning-gym tasks as a verl-schema .jsonl/.parquet file.")
    parser.add_argument("name", help="a reasoning-gym dataset, e.g. basic_arithmetic, leg_counting")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default="{}", help="the dataset's config as JSON, e.g. '{\"max_terms\": 3}'")
    parser.add_argument("--out", required=True, help="output file (.jsonl or .parquet)")
    args = parser.parse_args(argv)
    write_records(args.out, records(args.name, size=args.size, seed=args.seed, config=json.loads(args.config)))
    print(f"wrote {args.size} {args.name} rows to {args.out}")


if __name__ == "__main__":
    main()
