"""`python -m train.unsent RUN_DIR`: the command's door in the hall; what it sends and how is
train/tracking/unsent.py, beside the tracker that keeps those files."""

from train.tracking.unsent import main

if __name__ == "__main__":
    raise SystemExit(main())
