"""The result of one doctor check, and the report that prints one line per check.

    OK   config rules       all cross-field rules hold (world_size = 1)
    WARN memory             rollout.batch_size = 64 likely does not fit ... → rollout.batch_size=16
    FAIL parallel settings  critic.hybrid_engine is set ... → delete critic.hybrid_engine
                            (detail lines, indented under the message)

Only formatting lives here; the checks are in `checks.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FAIL = "OK", "WARN", "FAIL"
STATUSES = (OK, WARN, FAIL)


@dataclass(frozen=True)
class CheckResult:
    name: str          # short, e.g. "reward model"
    status: str        # OK, WARN or FAIL
    message: str       # what was found (one line; extra lines are printed indented)
    fix: str = ""      # what to change (shown after → on WARN and FAIL)
    details: tuple = ()  # further lines printed under the message (tables, arithmetic)

    def __post_init__(self):
        assert self.status in STATUSES, self.status


def any_failed(results: list[CheckResult]) -> bool:
    return any(r.status == FAIL for r in results)


def format_report(results: list[CheckResult]) -> str:
    """One line per check (`STATUS name  message → fix`), detail lines indented under it, then a summary."""
    lines = _check_lines(results, details=True)
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    verdict = ("the run would fail or waste GPU time: fix the FAIL lines first" if counts[FAIL]
               else "ready to train" + (" (read the WARN lines)" if counts[WARN] else ""))
    lines.append(f"{len(results)} checks: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL; {verdict}")
    return "\n".join(lines)


def format_failures(results: list[CheckResult]) -> str:
    """The FAIL lines alone (message and fix, no detail tables): what a stopped run repeats last, so that the
    reason is the end of the output and not the middle of the report."""
    return "\n".join(_check_lines([r for r in results if r.status == FAIL], details=False))


def _check_lines(results: list[CheckResult], *, details: bool) -> list[str]:
    width = max((len(r.name) for r in results), default=0)
    indent = " " * (5 + width + 2)
    lines = []
    for r in results:
        first, *rest = r.message.splitlines() or [""]
        arrow = f"→ {r.fix}" if r.fix and r.status != OK else ""
        if arrow and not rest:  # one-line message: the fix goes on the same line
            first, arrow = f"{first} {arrow}", ""
        lines.append(f"{r.status:<4} {r.name:<{width}}  {first}")
        lines.extend(indent + line for line in [*rest, *([arrow] if arrow else []), *(r.details if details else ())])
    return lines
