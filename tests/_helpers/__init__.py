"""Test helpers (not tests): rank launcher, references, shared models, launched scripts.

``tests/`` is on ``sys.path`` under pytest (rootdir-relative imports), so test files import
``from _helpers.dist_harness import launch``; benchmarks and launched scripts put ``tests/``
on the path themselves.
"""
