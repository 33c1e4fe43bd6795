"""Built-in rule rewards: plain functions `fn(prompt, response, ground_truth, **row) -> float`.

`prompt` is the dataset prompt (a string or a list of chat messages), `response` the decoded text
without special tokens, `ground_truth` the row's `reward_model.ground_truth`, and `row` the record's
other fields (ignored by the built-ins). Each built-in returns a float in [0, 1].

This module only judges one response. Weighting, validating return values and turning a config
name into a function live in `registry.py`.
"""
from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation
from typing import Callable, Optional

from phaserl.errors import RewardError

# "  -68 " -> "-68"; anything else around the number is a wrong answer for the tiny task.
_TINY_ANSWER = re.compile(r"\s*(-?\d+)\s*")
# A GSM8K number: optional minus, digits with thousands commas, optional decimals.
_GSM8K_NUMBER = re.compile(r"\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)")
_BOXED = "\\boxed{"
# math-verify's own timeouts use signal.alarm, which only works in the main thread.
_MATH_VERIFY_TIMEOUT_S = 5


def tiny_exact(prompt, response: str, ground_truth, **row) -> float:
    """1.0 when the response is exactly the integer ground truth (surrounding whitespace allowed)."""
    match = _TINY_ANSWER.fullmatch(response)
    if match is None:
        return 0.0
    return 1.0 if int(match.group(1)) == _as_int(ground_truth, "tiny_exact") else 0.0


def gsm8k(prompt, response: str, ground_truth, format_score: float = 0.0, **row) -> float:
    """GSM8K: compare the number after the last "####" with the ground truth.

    Correct: 1.0; a "####" number that is wrong: `format_score`; no "####" number: 0.0.
    Commas are dropped and the numbers compared by value ("72.0" == "72"); a trailing period is fine.
    """
    answer = _last_hash_answer(response)
    if answer is None:
        return 0.0
    truth_text = str(ground_truth)
    if "####" in truth_text:  # a full GSM8K solution was passed as ground truth
        truth_text = _last_hash_answer(truth_text) or truth_text
    truth = _as_decimal(truth_text)
    if truth is None:
        raise RewardError(f"gsm8k: ground truth {ground_truth!r} is not a number; the gsm8k reward needs "
                          f"reward_model.ground_truth to be the final numeric answer (e.g. '72').")
    return 1.0 if _as_decimal(answer) == truth else float(format_score)


def boxed_math(prompt, response: str, ground_truth, **row) -> float:
    """1.0 when the last balanced \\boxed{...} in the response equals the ground truth per math-verify."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise RewardError("the boxed_math reward needs math-verify: pip install math-verify") from exc
    content = last_boxed(response)
    if content is None:
        return 0.0
    # signal-based timeouts fail outside the main thread; there we run without them.
    in_main = threading.current_thread() is threading.main_thread()
    timeout = _MATH_VERIFY_TIMEOUT_S if in_main else None
    truth_text = str(ground_truth).strip()
    if "\\boxed" not in truth_text and "$" not in truth_text:
        truth_text = f"${truth_text}$"
    gold = parse(truth_text, parsing_timeout=timeout)
    if not gold:
        raise RewardError(f"boxed_math: math-verify could not parse the ground truth {ground_truth!r}; "
                          f"fix reward_model.ground_truth in that row (LaTeX or a plain number).")
    predicted = parse(_BOXED + content + "}", parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0


def format_reward(prompt, response: str, ground_truth, pattern: str = r".*\\boxed\{.+\}.*", **row) -> float:
    """1.0 when the stripped response matches `pattern` in full (re.DOTALL), else 0.0."""
    return 1.0 if re.fullmatch(pattern, response.strip(), re.DOTALL) else 0.0


def last_boxed(text: str) -> Optional[str]:
    """The content of the last \\boxed{...} whose braces close, or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth = 0
        for i in range(start + len(_BOXED) - 1, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED):i]
        start = text.rfind(_BOXED, 0, start)  # unclosed (e.g. a cut-off response): try the one before
    return None


def _last_hash_answer(text: str) -> Optional[str]:
    """The number right after the last "####", commas removed, or None."""
    at = text.rfind("####")
    if at == -1:
        return None
    match = _GSM8K_NUMBER.match(text, at + 4)
    return match.group(1).replace(",", "") if match else None


def _as_decimal(text: str) -> Optional[Decimal]:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None  # "NaN" and "Infinity" parse as Decimals


def _as_int(ground_truth, reward_name: str) -> int:
    try:
        return int(str(ground_truth).strip())
    except ValueError as exc:
        raise RewardError(f"{reward_name}: ground truth {ground_truth!r} is not an integer; this reward "
                          f"needs reward_model.ground_truth to be a whole number such as 68.") from exc


BUILTIN_REWARDS: dict[str, Callable[..., float]] = {
    "tiny_exact": tiny_exact,
    "gsm8k": gsm8k,
    "boxed_math": boxed_math,
    "format": format_reward,
}
