"""The grader's verdict: what it found, why, and how it is shown and returned.

Every outcome has a *status* (pass, fail, broken, error), which sets the exit code,
and a *reason*, a stable keyword a script or a test can match on. The message says
in words what happened and, where it can, what to do about it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Exit codes of ``lab-grade`` (also documented in assessment/README.md).
EXIT_PASS = 0  # the target was met
EXIT_FAIL = 1  # the submission ran and was judged, but missed the target
EXIT_BROKEN = 2  # the submission did not run to a usable checkpoint
EXIT_ERROR = 3  # the grader itself could not judge (bad target, missing data, bad usage)

STATUS_EXIT = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "broken": EXIT_BROKEN, "error": EXIT_ERROR}

# reason -> status. The reasons are the verdicts a submission can get.
REASONS = {
    "passed": "pass",
    "low_accuracy": "fail",  # valid checkpoint, below the target accuracy
    "over_budget": "fail",  # finished and saved, but after the budget
    "timeout": "fail",
    "not_data_parallel": "fail",  # met the target, but not every rank exchanged gradients  # still running at budget + grace: stopped (a hang, a deadlock, too slow)
    "syntax_error": "broken",  # the script does not compile; it was not started
    "crashed": "broken",  # the job exited with an error status (any rank)
    "no_checkpoint": "broken",  # exited cleanly but wrote no checkpoint.pt
    "checkpoint_outside": "broken",  # checkpoint.pt is a link or points outside the working dir
    "unsafe_checkpoint": "broken",  # torch.load(weights_only=True) refused it (pickled code)
    "unreadable_checkpoint": "broken",  # not a torch file at all, or truncated
    "bad_checkpoint": "broken",  # readable, but not {arch, kwargs, state_dict}
    "wrong_arch": "broken",  # arch unknown, not allowed by the target, or kwargs do not fit
    "wrong_shape": "broken",  # state_dict keys or shapes do not fit the rebuilt model
    "nan_weights": "broken",  # weights or buffers hold NaN or infinity
    "tampered": "broken",  # the job changed the grader's code, the target or the test data
    "grader_error": "error",  # the grader could not do its job
    "slurm_killed": "error",  # Slurm ended the grading job first (time limit, node failure, scancel)
}


@dataclass
class Report:
    """Everything the grader measured about one submission."""

    submission: str
    target: str
    dataset: str
    launcher: str
    nprocs: int
    budget_s: float
    grace_s: float
    required_accuracy: float
    reason: str = "grader_error"
    message: str = ""
    accuracy: float | None = None  # measured by the grader on the held-out test split
    test_samples: int | None = None
    elapsed_s: float | None = None  # wall clock from launch to the last process's exit
    timed_out: bool = False
    returncode: int | None = None
    checkpoint: dict[str, Any] | None = None  # arch, kwargs, parameter count, size
    warnings: list[str] = field(default_factory=list)
    output_tail: list[str] = field(default_factory=list)
    leftover_processes: int = 0
    workdir: str = ""  # the job's working directory (removed afterwards unless kept)
    job_id: str = ""  # the tag in the environment of every process of the job
    environment: dict[str, Any] = field(default_factory=dict)
    ranks: list[dict[str, Any]] = field(default_factory=list)  # each rank's CPU time, samples
    unsafe: bool = False  # graded without the sandbox (--unsafe-no-sandbox)

    @property
    def status(self) -> str:
        return REASONS[self.reason]

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def exit_code(self) -> int:
        return STATUS_EXIT[self.status]

    def set(self, reason: str, message: str) -> Report:
        """Record the verdict (``reason`` must be one of :data:`REASONS`)."""
        if reason not in REASONS:
            raise ValueError(f"unknown verdict reason {reason!r}")
        self.reason, self.message = reason, message
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(status=self.status, passed=self.passed, exit_code=self.exit_code)
        return d

    def write_json(self, path: str | os.PathLike) -> None:
        """Write the report as JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.part")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)

    def text(self, tail_lines: int = 15) -> str:
        """The report as a reader would want it in a terminal."""
        headline = {
            "pass": "PASS",
            "fail": "FAIL",
            "broken": "BROKEN SUBMISSION",
            "error": "GRADER ERROR",
        }[self.status]
        acc = "not measured" if self.accuracy is None else f"{self.accuracy:.2%}"
        if self.test_samples:
            acc += f" on {self.test_samples} held-out test images"
        took = "not measured" if self.elapsed_s is None else f"{self.elapsed_s:.1f} s"
        if self.timed_out:
            took += f" (stopped at budget + grace = {self.budget_s + self.grace_s:g} s)"
        lines = [
            *(
                [
                    "UNSAFE: graded without a sandbox; the submission could read the test split "
                    "and change files, so do not trust this verdict"
                ]
                if self.unsafe
                else []
            ),
            f"{headline}: {self.reason}",
            f"  {self.message}",
            "",
            f"  submission  {self.submission}",
            f"  target      {self.target}: {self.dataset}, accuracy >= "
            f"{self.required_accuracy:.2%} within {self.budget_s:g} s, "
            f"{self.nprocs} processes under {self.launcher}",
            f"  accuracy    {acc}",
            f"  time        {took}",
        ]
        if self.checkpoint:
            c = self.checkpoint
            lines.append(
                f"  checkpoint  {c.get('arch')} {c.get('kwargs')}, "
                f"{c.get('parameters', '?')} parameters"
            )
        if self.ranks:
            lines.append(
                "  ranks       "
                + ", ".join(
                    f"{r['rank']}: {r['cpu_s']:.1f} s CPU"
                    + (
                        f", {r['sent_mb']:.2f}/{r['received_mb']:.2f} MB sent/received"
                        if "sent_mb" in r
                        else ""
                    )
                    + (f", {r['gpu_share']:.0%} of the busiest GPU use" if "gpu_share" in r else "")
                    + (f", {r['samples_share']:.0%} of samples" if "samples_share" in r else "")
                    for r in self.ranks
                )
            )
        lines += [f"  warning     {w}" for w in self.warnings]
        if self.output_tail and self.status in ("broken", "fail") and self.reason != "low_accuracy":
            lines += ["", "  last lines of the job's output:"]
            lines += [f"    | {line}" for line in self.output_tail[-tail_lines:]]
        return "\n".join(lines)
