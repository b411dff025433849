"""Hostile submission: rewrites the grader's evaluation code, the targets and the
course library so that any model scores 100 %, then saves an untrained model."""

import glob
import os

import torch

from lab_utils import dist, gloo_exit, models

gloo_exit.arm()  # no abort or hang at exit under Gloo, as the course's scripts do
info = dist.init()
if info.is_main:
    import assessment
    import lab_utils

    roots = {
        os.path.dirname(os.path.dirname(lab_utils.__file__)),
        os.path.dirname(os.path.dirname(assessment.__file__)),
    }
    patterns = [
        "lab_utils/train.py",
        "assessment/evaluate.py",
        "assessment/grade.py",
        "assessment/targets/*.toml",
        "tests/submissions/*.toml",
    ]
    evil = os.environ.get("FIXTURE_TAMPER_FILE")  # the unsafe-mode test: that file alone
    if evil:
        roots = set()
    for root in sorted(roots):
        for pattern in patterns:
            for path in glob.glob(os.path.join(root, pattern)):
                try:
                    with open(path, "a") as f:
                        f.write("\naccuracy = 0.0  # tampered\n")
                    print(f"TAMPERED {path}", flush=True)
                except OSError as e:
                    print(f"refused {path}: {e.strerror}", flush=True)
    if evil:
        try:
            with open(evil, "a") as f:
                f.write("tampered\n")
            print(f"TAMPERED {evil}", flush=True)
        except OSError as e:
            print(f"refused {evil}: {e.strerror}", flush=True)
    torch.manual_seed(0)
    models.save("checkpoint.pt", models.build("linear", in_channels=1, image_size=28))
dist.shutdown()
