"""Reference solutions of the exercises, one module per lab (``lab1.py``, ...).

Notebooks use them only when ``LABS_SOLUTIONS=1``; see :mod:`lab_utils.exercises`.
"""
