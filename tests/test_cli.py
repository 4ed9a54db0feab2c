"""`python -m train` end to end, in subprocesses, as a user runs it."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torchvision

from support.launch import PYTHON, launch, run_train, wait_for
from support.runs import tiny_overrides
from support.tracking import mlflow_runs, sweep_runs
from checkpointing.export import export, read_model_card


def test_a_tiny_run_trains_logs_to_mlflow_and_saves_weights(tmp_path, tiny_root):
    db = tmp_path / "mlflow.db"
    result = run_train(["+experiment=resnet", *tiny_overrides(tiny_root), "data.num_workers=2",
                        "optim.lr=0.005", f"logger.tracking_uri=sqlite:///{db}"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    client, runs = mlflow_runs(db)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    name = run.data.tags["mlflow.runName"]
    assert name.startswith("resnet-data.global_batch_size=20,data.image_size=32")
    assert (tmp_path / "outputs" / name / "model_final.pt").is_file()
    for key in ["train/loss", "train/lr", "train/images_per_second", "data/fetch_seconds",
                "data/fetch_seconds_p99", "data/first_batch_seconds", "val/loss", "val/top1"]:
        assert key in run.data.metrics, key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/top1")] == [6, 12]
    assert run.data.params["optim.lr"] == "0.005"
    assert run.data.params["data.num_workers"] == "2"
    # As typed on the command line: enums by value, nulls and booleans in YAML's spelling
    assert run.data.params["optim.name"] == "adamw"
    assert run.data.params["checkpoint.staging_dir"] == "null"
    assert run.data.params["trainer.save_final_weights"] == "true"
    assert run.data.metrics["goodput/fraction"] == run.data.metrics["goodput"]
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    config = Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path)))
    assert "global_batch_size: 20" in config.read_text()
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert {"goodput.png", "goodput.json", "train.log", "config.yaml"} <= set(artifacts)
    weights = torch.load(tmp_path / "outputs" / name / "model_final.pt", weights_only=True)
    model = torchvision.models.get_model("resnet18", num_classes=10)
    model.load_state_dict(weights, strict=True)  # the model card is no key of it
    assert run.data.params["model.parameters"] == str(sum(p.numel() for p in model.parameters()))
    assert_the_model_card(weights.model_card)
    assert_the_mlflow_model_predicts_as(model.eval(), run.info.run_id, db, tmp_path)
    for out in ("m.pt", "m.safetensors"):  # the export carries the card too
        export(str(tmp_path / "outputs" / name / "checkpoints"), tmp_path / out)
        assert read_model_card(tmp_path / out) == weights.model_card


def assert_the_model_card(card: dict) -> None:
    assert card["num_classes"] == 10 and len(card["classes"]) == 10
    assert card["classes"][:2] == ["arrow", "circle"] and card["image_size"] == 32
    assert card["mean"] == [0.485, 0.456, 0.406] and card["std"] == [0.229, 0.224, 0.225]


def assert_the_mlflow_model_predicts_as(model: torch.nn.Module, run_id: str, db: Path,
                                        tmp_path: Path) -> None:
    """mlflow.pytorch.load_model in a fresh process gives the logits of the saved weights,
    for a batch of another size than the input example's."""
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.save(images, tmp_path / "images.pt")
    script = ("import sys, mlflow, torch; mlflow.set_tracking_uri(sys.argv[1]); "
              "m = mlflow.pytorch.load_model(f'runs:/{sys.argv[2]}/model'); "
              "torch.save(m(torch.load(sys.argv[3])).detach(), sys.argv[4]); "
              "info = mlflow.models.get_model_info(f'runs:/{sys.argv[2]}/model'); "
              "print(info.metadata['num_classes'], info.signature.inputs.to_dict())")
    loaded = subprocess.run([*PYTHON, "-c", script, f"sqlite:///{db}", run_id,
                             str(tmp_path / "images.pt"), str(tmp_path / "logits.pt")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    number, inputs = loaded.stdout.strip().splitlines()[-1].split(" ", 1)
    assert number == "10" and "(-1, 3, 32, 32)" in inputs, loaded.stdout
    with torch.no_grad():
        expected = model(images)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected)


def test_a_multirun_sweep_gives_one_mlflow_run_per_job(tmp_path, tiny_root):
    db = tmp_path / "mlflow.db"
    result = run_train(["-m", "+experiment=resnet", *tiny_overrides(tiny_root),
                        "trainer.max_steps=2", "optim.lr=0.01,0.02",
                        f"logger.tracking_uri=sqlite:///{db}", "logger.log_model=false"],
                       cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, runs = mlflow_runs(db)
    parent, jobs = sweep_runs(runs)
    assert sorted(r.data.params["optim.lr"] for r in jobs) == ["0.01", "0.02"]
    names = {r.data.tags["mlflow.runName"] for r in jobs}
    assert len(names) == 2
    assert all((tmp_path / "outputs" / n / "model_final.pt").is_file() for n in names)
    assert parent.data.tags["sweep.sweeper"].endswith("BasicSweeper")


def train_weights(tmp_path: Path, tiny_root: Path, out: str, *extra: str) -> dict:
    result = run_train(["+experiment=resnet", *tiny_overrides(tiny_root), "logger=none",
                        "trainer.max_steps=4", f"run.root={tmp_path / out}", "run.name=r",
                        *extra], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(tmp_path / out / "r" / "model_final.pt", weights_only=True)


def test_same_seed_twice_gives_bit_identical_weights(tmp_path, tiny_root):
    a = train_weights(tmp_path, tiny_root, "a", "data.num_workers=2")
    b = train_weights(tmp_path, tiny_root, "b", "data.num_workers=0")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The control: another seed must change the result, or this test could not fail.
    c = train_weights(tmp_path, tiny_root, "c", "seed=1")
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("override, expected", [
    ("data.root={missing}", "data.root {missing} does not exist"),
    ("data.root={empty}", "data.root {empty} is empty"),
    ("model.name=resnet19", "unknown model.name 'resnet19'"),
    ("data.global_batch_size=1000", "exceeds the dataset's 120 samples"),
])
def test_user_errors_are_one_line_without_a_traceback(tmp_path, tiny_root, override, expected):
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    overrides = [*tiny_overrides(tiny_root), "logger=none", override.format(**paths)]
    result = run_train(["+experiment=resnet", *overrides], cwd=tmp_path)
    assert result.returncode == 2
    errors = result.stderr.strip().splitlines()
    assert errors == [errors[-1]] and errors[0].startswith("error: ")
    assert expected.format(**paths) in errors[0]


def test_a_resumed_run_keeps_logging_into_the_same_mlflow_run(tmp_path, tiny_root):
    db = tmp_path / "mlflow.db"
    args = ["+experiment=resnet", *tiny_overrides(tiny_root), "run.name=r",
            "checkpoint.interval_steps=3", f"logger.tracking_uri=sqlite:///{db}",
            "logger.log_model=false"]
    for max_steps in (3, 8):
        result = run_train([*args, f"trainer.max_steps={max_steps}"], cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
    client, runs = mlflow_runs(db)
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags["resumed"] == "true"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == [2, 3, 4, 6, 8]  # the second life logged on from step 4


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path, tiny_root):
    """Before training routes SIGINT to a checkpoint, Ctrl-C lands in whatever import runs
    (here torch's, seconds long): one line, no KeyboardInterrupt traceback."""
    proc = launch(PYTHON, ["-m", "train", "+experiment=resnet", *tiny_overrides(tiny_root),
                           "logger=none", f"run.root={tmp_path}"],
                  cwd=tmp_path, stderr_apart=True)
    maps = Path(f"/proc/{proc.pid}/maps")
    wait_for(lambda: "torch" in maps.read_text(), "torch to load", proc=proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["interrupted before training started: nothing to save"]
    assert "Traceback" not in out
