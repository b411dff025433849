"""lab_utils.settings: a lab's sizes by profile, read by notebooks, scripts and tests."""

from __future__ import annotations

import pytest

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
