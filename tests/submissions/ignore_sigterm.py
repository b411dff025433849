"""Hostile submission: every rank ignores SIGTERM and never ends."""

import signal
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ignoring SIGTERM, running forever", flush=True)
while True:
    time.sleep(0.5)
