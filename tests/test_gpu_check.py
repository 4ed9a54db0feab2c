"""benchmarks/gpu_check.sh's CPU fallback: the GPU check's every step (synthetic JPEGs, a run
under torchrun with checkpoints, a SIGKILL and the resume, the summary and the report) with
tiny sizes, so the script a GPU machine runs is known to work before one is at hand. One
strategy, FSDP (the other, DDP, is the same command with another `strategy=`): every
trainer start costs seconds here."""

from __future__ import annotations

import re
import subprocess

from support.launch import train_env
from support.runs import REPO


def test_the_gpu_check_runs_on_cpu_and_prints_its_figures(tmp_path):
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), str(tmp_path)],
                            env=train_env(DEVICE="cpu", STRATEGIES="fsdp"),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    line = re.search(r"^fsdp: (\d+) images/s .* data/fetch_seconds [\d.]+% of a step; "
                     r"checkpoint stall median [\d.]+s, save [\d.]+s \((\d+) saves\); "
                     r"goodput [\d.]+% with 1 restart\(s\)", result.stdout, re.M)
    assert line and int(line[1]) > 0 and int(line[2]) >= 4, result.stdout[-3000:]
    assert "failures 1 (killed 1)" in result.stdout  # train.records.report's table
    assert (tmp_path / "fsdp-goodput.png").stat().st_size > 0
