"""lab_utils.settings: a lab's sizes by profile, read by notebooks, scripts and tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

from lab_utils.settings import By, Settings, option

S = Settings(d_model=By(quick=64, cpu=128, gpu=512), heads=4, sizes_kb=By([4], [4, 64], [64]))


def test_each_profile_gets_its_own_value_and_constants_stay():
    assert [S.of(p).d_model for p in ("quick", "cpu", "gpu")] == [64, 128, 512]
    assert S.of("gpu").heads == 4 and S.of("gpu")["heads"] == 4


def test_the_current_profile_is_the_default(monkeypatch):
    monkeypatch.setenv("LABS_PROFILE", "cpu")
    assert S.of().d_model == 128 and S.of().profile == "cpu"


def test_a_scripts_command_line_from_the_same_values():
    assert S.args("d_model", "heads", profile="quick") == ["--d-model", "64", "--heads", "4"]
    assert S.args("sizes_kb", profile="cpu") == ["--sizes-kb", "4", "64"]
    assert option("bucket_cap_mb") == "--bucket-cap-mb"


def test_mistakes_are_named():
    with pytest.raises(AttributeError, match="no setting 'width'.*d_model"):
        S.of("quick").width  # noqa: B018
    with pytest.raises(KeyError, match="no setting width"):
        S.args("width")
    with pytest.raises(ValueError, match="no profile 'fast'"):
        S.of("fast")
    with pytest.raises(TypeError, match="flag"):
        Settings(augment=True).args("augment", profile="quick")


# ------------------------------------------------------------- one place per lab
# the profile API itself and its tests
ALLOWED = {
    "lab_utils/profile.py",
    "lab_utils/settings.py",
    "tests/test_profile.py",
    "tests/test_checks_of_a_run.py",  # script_parser showing a profile's default
}


def picks_outside_settings(root: Path = REPO) -> list[str]:
    """Files that choose a size by profile (``.pick(`` or ``By(``) outside the places
    that hold them: a lab's ``labN_settings.py``, ``parallel.MODEL`` (Labs 4, 6, 7's model)."""
    files = [
        *root.glob("labs/**/*.py"),
        *root.glob("labs/**/*.ipynb"),
        *root.glob("lab_utils/**/*.py"),
        *root.glob("benchmarks/**/*.py"),
        *root.glob("tests/*.py"),
        *root.glob("assessment/**/*.py"),
    ]
    found = []
    for f in files:
        rel = f.relative_to(root).as_posix()
        if ".ipynb_checkpoints" in rel or rel in ALLOWED or rel == "tests/test_settings.py":
            continue
        if re.fullmatch(r"labs/lab\d+_\w+/lab\d+_settings\.py", rel):
            continue
        text = f.read_text(encoding="utf-8")
        if rel == "lab_utils/parallel.py":
            text = text.split("MODEL = Settings(", 1)[0] + text.split("\n)\n", 1)[-1]
        if re.search(r"\.pick\(|\bBy\(", text):
            found.append(rel)
    return sorted(found)


def test_every_size_by_profile_lives_in_its_labs_settings():
    assert picks_outside_settings() == []


def test_a_pick_outside_the_settings_is_found(tmp_path):
    (tmp_path / "labs" / "lab9_x").mkdir(parents=True)
    (tmp_path / "labs" / "lab9_x" / "lab9_settings.py").write_text("S = By(quick=1, cpu=2, gpu=3)")
    (tmp_path / "labs" / "lab9_x" / "01_a.ipynb").write_text('"N = P.pick(quick=1, cpu=2, gpu=3)"')
    assert picks_outside_settings(tmp_path) == ["labs/lab9_x/01_a.ipynb"]
