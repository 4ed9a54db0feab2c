"""The training application: `python -m train +experiment=resnet`."""

import time

# Goodput counts start-up from here, the first thing `python -m train` runs, so the time
# spent importing torch after a restart is counted too (train/goodput.py).
PROCESS_START = time.perf_counter()
