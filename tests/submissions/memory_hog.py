"""Hostile submission: takes far more memory than the target allows (and touches it,
so that it is really used)."""

import time

print("allocating 6 GB", flush=True)
blocks = []
for _ in range(24):
    block = bytearray(256 * 2**20)
    block[::4096] = b"x" * len(block[::4096])
    blocks.append(block)
print("got all of it", flush=True)
time.sleep(1)
