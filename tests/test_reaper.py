import os
import subprocess
import sys
import textwrap
import time

from conftest import TEST_TAG, processes_matching, wait_started

ORPHAN_MAKER = textwrap.dedent("""
    import subprocess, sys
    # A grandchild in a session of its own, then we exit: an orphan, as horovodrun makes.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "{marker}"],
                     start_new_session=True)
    sys.exit(3)
""")


def test_reaper_kills_orphans_and_keeps_the_exit_status():
    marker = "reaper-orphan-5b1c"
    code = ORPHAN_MAKER.format(marker=marker)
    start = time.perf_counter()
    rc = subprocess.call(
        [sys.executable, "-m", "lab_utils.reaper", "--", sys.executable, "-c", code], timeout=60
    )
    assert rc == 3
    assert time.perf_counter() - start < 30
    assert processes_matching(marker) == []


def test_reaper_stops_the_tree_on_sigterm():
    marker = "reaper-sigterm-9a2f"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lab_utils.reaper",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(120)",
            marker,
        ]
    )

    def job():  # the sleeper itself, not the reaper whose command line also names it
        return [p for p in processes_matching(marker) if "lab_utils.reaper" not in p.cmdline()]

    deadline = time.time() + 20
    while not job() and time.time() < deadline:
        time.sleep(0.1)
    assert job(), "the job never started"
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    assert processes_matching(marker) == []


def test_reaper_usage_error():
    assert (
        subprocess.call([sys.executable, "-m", "lab_utils.reaper"], stderr=subprocess.DEVNULL) == 2
    )


def test_a_leftover_counts_only_for_the_test_that_started_it():
    """The other pytest worker may run the same script at the same moment: its processes
    carry another tag and are not this test's leftovers; this test's own are found."""
    marker = "leftover-tag-3e7d"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)", marker]
    other = subprocess.Popen(sleep, env=dict(os.environ, **{TEST_TAG: "another-test"}))
    ours = subprocess.Popen(sleep)
    try:
        wait_started(other, marker)
        wait_started(ours, marker)
        assert [p.pid for p in processes_matching(marker)] == [ours.pid]
    finally:
        for proc in (other, ours):
            proc.kill()
            proc.wait()
    assert processes_matching(marker) == []
