"""Imported at the start of every Python process the suite starts (tests/conftest.py puts this
folder on PYTHONPATH): a first-generation garbage collection after every 100,000 new container
objects instead of CPython's 700.

A lab's start creates millions of objects (torch's import, torch._dynamo's on the first
optimizer) and frees almost none: at 700, CPython walks them again and again, about 0.3 s of the
~3 s of CPU a one-process lab run costs on the course's 2-core machine. The suite starts over a
thousand such processes. Nothing a test checks depends on when cycles are collected (the one
wrong answer whose message does, notebook 11's unassigned Horovod wrapper, accepts either
message); learners' processes keep CPython's default.
"""
import gc

gc.set_threshold(100_000, 50, 1_000)
