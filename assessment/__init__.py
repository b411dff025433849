"""The assessment: make a serial training script data-parallel and meet an
accuracy-in-time target; graded by ``lab-grade`` (:mod:`assessment.cli`).

Modules: :mod:`~assessment.cli` (the command line), :mod:`~assessment.options`
(options the subcommands share), :mod:`~assessment.grade` (the grading steps),
:mod:`~assessment.sandbox` (working directory, launch, process clean-up),
:mod:`~assessment.jail` (the bubblewrap sandbox and its limits),
:mod:`~assessment.integrity` (hashes before and after a job),
:mod:`~assessment.evaluate` (the evaluation in a fresh process),
:mod:`~assessment.batch` (grading a folder of submissions),
:mod:`~assessment.results` (a class's results files),
:mod:`~assessment.slurm` (the batch as a Slurm job array),
:mod:`~assessment.checkpoint` (reading and checking the checkpoint),
:mod:`~assessment.targets` (target files), :mod:`~assessment.report` (verdicts,
exit codes), :mod:`~assessment.calibrate` (proposing targets for a machine).
"""
