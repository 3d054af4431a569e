"""Rank 1 fails with a message while rank 0 waits (tests/test_launch.py)."""
import os
import sys
import time

if os.environ["RANK"] == "1":
    sys.exit("rank 1 gives up")
time.sleep(30)
