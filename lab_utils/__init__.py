"""Shared library of the labs on training neural networks at scale.

Each module has one job; import the one you need, e.g. ``from lab_utils import data``.
Nothing heavy is imported here so that ``import lab_utils`` stays fast.
"""

__version__ = "0.1.0"
