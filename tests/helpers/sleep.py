"""Every rank writes its pid and sleeps forever (tests/test_launch.py)."""
import os
import sys
import time

with open(sys.argv[1], "a") as f:
    f.write(f"{os.getpid()}\n")
print("sleeping", flush=True)
time.sleep(3600)
