"""Test job: every rank sleeps far past any sensible timeout."""

import time

time.sleep(600)
