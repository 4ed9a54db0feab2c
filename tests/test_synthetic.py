"""The embedded dataset: deterministic bytes, real JPEGs of the requested size, atomic."""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path

import pytest
from PIL import Image

from common.progress import task_progress
from data import synthetic


def digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*.jpg"))}


def test_same_seed_same_bytes_whatever_the_worker_count(tmp_path):
    a = synthetic.generate(tmp_path / "a", 30, 10, 40, seed=7, workers=1)
    b = synthetic.generate(tmp_path / "b", 30, 10, 40, seed=7, workers=2)
    c = synthetic.generate(tmp_path / "c", 30, 10, 40, seed=8, workers=2)
    assert len(digest(a)) == 40
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)


@pytest.mark.parametrize("size", [32, 500])
def test_files_are_valid_jpegs_of_the_requested_size(size):
    for index in range(10):
        label, data = synthetic.render(0, "train", index, size)
        image = Image.open(io.BytesIO(data))
        assert image.format == "JPEG" and image.mode == "RGB"
        assert image.size == (size, synthetic.image_height(size))
        assert label == index % len(synthetic.CLASSES)
        image.load()  # decodes fully: not truncated


def test_imagefolder_layout_with_balanced_classes(tmp_path):
    root = synthetic.generate(tmp_path / "d", 40, 20, 32, workers=2)
    for split, n in (("train", 40), ("val", 20)):
        counts = [len(list((root / split / c).glob("*.jpg"))) for c in synthetic.CLASSES]
        assert counts == [n // 10] * 10
    assert not list(tmp_path.glob(".d.tmp-*"))  # the temporary directory was renamed away


def test_a_complete_dataset_is_reused_and_a_foreign_folder_refused(tmp_path):
    root = synthetic.generate(tmp_path / "d", 20, 10, 32, workers=1)
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")}
    synthetic.generate(root, 20, 10, 32, workers=1)
    assert before == {p: p.stat().st_mtime_ns for p in root.rglob("*.jpg")}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="other"):
        synthetic.generate(tmp_path / "other", 20, 10, 32, workers=1)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_command_line(tmp_path, capsys):
    out = tmp_path / "cli"
    assert synthetic.main(["--out", str(out), "--num-train", "20", "--num-val", "10",
                           "--size", "48", "--workers", "1"]) == 0
    assert len(list(out.rglob("*.jpg"))) == 30
    assert Image.open(next(out.rglob("*.jpg"))).size == (48, 36)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    assert synthetic.main(["--out", str(tmp_path / "busy")]) == 2
    assert "busy" in capsys.readouterr().err


def test_progress_off_a_terminal_logs_its_first_update_every_tenth_and_the_end(caplog):
    """The one tty/non-tty rule (common.progress) the data generation and the training
    bar share: off a terminal nothing animates, a few plain lines are logged."""
    log = logging.getLogger("data.synthetic")
    with caplog.at_level("INFO", logger="data.synthetic"):
        with task_progress("generating shapes", 95, log) as update:
            for done in range(96):
                update(done, 95)
    done = [r.getMessage().split()[2] for r in caplog.records if r.name == "data.synthetic"]
    assert done == [f"{n}/95" for n in (0, 9, 18, 27, 36, 45, 54, 63, 72, 81, 90, 95)]
