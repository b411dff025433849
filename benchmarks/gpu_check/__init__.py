"""The GPU check: one command that runs every lab's GPU code on one GPU and prints what passed.

    python -m benchmarks.gpu_check --out DIR          # on a machine with one GPU (<= 8 min)
    python -m benchmarks.gpu_check --cpu --out DIR    # the same harness on CPU, smallest sizes

Each *path* (a script under its launcher, Lab 6's probe, a notebook, the grader) runs in
its own supervised process with its own timeout, under one deadline for the whole check;
a failing path never stops the others, and what no longer fits is skipped with "no time
left". The table (``DIR/gpu_check.md`` and ``DIR/gpu_check.json``) says for every path
whether it passed, failed (with its error's last lines) or was skipped (with why), and
the numbers it measured. CONTRIBUTING.md, "GPU check", says what to copy to a GPU
machine and what to run there (DESIGN.md §17: the machines come for minutes, offline).

Modules, one job each:

- ``harness``: a path, its result, running one under the deadline, running them all;
- ``catalogue``: the paths of the GPU run and of the CPU form, with their sizes;
- ``report``: the table as markdown and JSON;
- ``bundle``: the wheels and data that travel to the GPU machine, unpacked there;
- ``lab6_probe``: Lab 6 on the device (autocast, GradScaler, peak memory, MFU, trace);
- ``notebook``: one notebook run top to bottom by nbclient (a path's process).
"""
