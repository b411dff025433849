import json

from lab_utils import metrics


def test_emit_writes_to_file_and_launcher_channel(tmp_path, monkeypatch):
    channel = tmp_path / "channel.jsonl"
    monkeypatch.setenv(metrics.ENV_VAR, str(channel))
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "sub" / "m.jsonl"
    metrics.emit({"epoch": 1, "acc": 0.5, "loss": float("nan")}, out)
    metrics.emit({"epoch": 2, "acc": 0.75}, out)
    for path in (out, channel):
        rows = metrics.read(path)
        assert [r["epoch"] for r in rows] == [1, 2]
        assert rows[0]["loss"] == "nan"


def test_only_rank0_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    metrics.emit({"x": 1}, tmp_path / "m.jsonl")
    assert not (tmp_path / "m.jsonl").exists()


def test_read_skips_a_truncated_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"a": 2, "b"')
    assert metrics.read(path) == [{"a": 1}]
    assert metrics.read(tmp_path / "missing.jsonl") == []


def test_events_picks_records_by_name_and_fields_in_order():
    records = [
        {"event": "timing", "algo": "ring", "ms": 1},
        {"event": "bucket", "algo": "ring"},
        {"event": "timing", "algo": "gloo", "ms": 2},
        {"event": "timing", "algo": "ring", "ms": 3},
        {"no_event": "timing"},
    ]
    assert [r["ms"] for r in metrics.events(records, "timing")] == [1, 2, 3]
    assert [r["ms"] for r in metrics.events(records, "timing", algo="ring")] == [1, 3]
    # a field the record lacks never matches, even when asked for None
    assert metrics.events(records, "bucket", ms=None) == []
    assert metrics.events(records, "eval") == []
