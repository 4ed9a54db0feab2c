"""`python -m train.report RUN_DIR`: the command's door in the hall; the report itself is
train/records/report.py, beside the records it reads."""

from train.records.report import main

if __name__ == "__main__":
    raise SystemExit(main())
