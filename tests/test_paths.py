"""lab_utils.paths: the runs folder follows the working directory, not the install."""

from __future__ import annotations

from lab_utils import paths


def test_runs_go_to_the_checkout_the_notebook_runs_in(tmp_path, monkeypatch):
    course = tmp_path / "course"
    (course / "labs" / "lab2").mkdir(parents=True)
    (course / "pyproject.toml").write_text("")
    assert paths.default_runs_root(course / "labs" / "lab2") == course / "runs"
    elsewhere = tmp_path / "my-notebooks"
    elsewhere.mkdir()
    assert paths.default_runs_root(elsewhere) == elsewhere / "runs"  # a shared install
    monkeypatch.delenv("LABS_RUNS", raising=False)
    monkeypatch.chdir(elsewhere)
    assert paths.runs_dir("lab2") == elsewhere / "runs" / "lab2"
    assert (elsewhere / "runs" / "lab2").is_dir()
    monkeypatch.setenv("LABS_RUNS", str(tmp_path / "chosen"))
    assert paths.runs_dir("lab2") == tmp_path / "chosen" / "lab2"
