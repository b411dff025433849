"""The three kinds of check a student's run may assert: a count, a comparison inside
one run with the run's own spread, and a timing that is shown, never raised."""

from __future__ import annotations

import pytest

from lab_utils import checks, profile


def test_count_passes_only_the_exact_count(capsys):
    checks.count(6, 6, what="all-reduces per block")
    assert "✔ all-reduces per block (6)" in capsys.readouterr().out
    with pytest.raises(checks.CheckFailed, match="counted 4, expected 6"):
        checks.count(4, 6, what="all-reduces per block")


def test_spread_is_robust_to_one_outlier():
    assert checks.spread([1.0]) == 0.0
    assert checks.spread([1.0, 1.0, 1.0, 9.0]) == 0.0  # one slow sample: no spread
    assert checks.spread([1.0, 2.0, 3.0]) == pytest.approx(1.4826)


def test_within_run_uses_the_runs_own_noise():
    margin = checks.within_run(0.30, 0.26, noise=0.02, what="bubble")
    assert margin == pytest.approx(4 * 0.02 - 0.04)
    with pytest.raises(checks.CheckFailed, match="predicted 0.1 "):
        checks.within_run(0.30, 0.10, noise=0.02, what="bubble")
    # a floor covers what the spread cannot see (e.g. a timer's resolution)
    checks.within_run(0.30, 0.10, noise=0.0, floor=0.25, what="bubble")


def test_shown_never_raises(capsys):
    checks.shown("speed-up", "1.2×", "a shared CPU")
    assert "shown, not asserted (a shared CPU)" in capsys.readouterr().out


def test_script_parser_shows_the_profiles_defaults(monkeypatch):
    monkeypatch.setenv("LABS_PROFILE", "cpu")
    p = profile.script_parser("A script.")
    p.add_argument(
        "--width",
        type=int,
        default=profile.current().pick(quick=1, cpu=16, gpu=64),
        help="channels",
    )
    text = p.format_help()
    assert "(default: 16)" in text and "'cpu' profile" in text
