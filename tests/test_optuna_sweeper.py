"""The Optuna sweeper (`hydra/sweeper=goodput_optuna`) against hydra-optuna-sweeper 1.3's own
test cases (its tests/test_optuna_sweeper_plugin.py: the grammar, the sphere with a seeded
TPE, the grid sampler, several objectives, a custom search space, the failure rate), then
what ours adds: no trial left RUNNING, a job's exit, an interruption, a resumed seeded study,
values that reach the job as written, and `best_overrides`. The sweeps run in this process
on a tiny app (tests/support/sphere.py), as Hydra's own sweeper tests run theirs."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, List

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

optuna = pytest.importorskip("optuna", reason="pip install '.[sweep]'")

from optuna.distributions import (CategoricalDistribution, FloatDistribution,  # noqa: E402
                                  IntDistribution)
from optuna.trial import TrialState  # noqa: E402

from hydra_plugins.goodput_optuna_sweeper._impl import SweepError, distribution  # noqa: E402
from support import sphere  # noqa: E402

APP = Path(sphere.__file__)
pytestmark = pytest.mark.usefixtures("hydra_restore_singletons")


def run_sweep(runner: Any, tmp_path: Path, *overrides: str, config: str = "sphere",
              task: Any = sphere.sphere):
    """The sweep as a context: inside it, `.returns` and the sweep directory (`.temp_dir`)."""
    return runner(calling_file=str(APP), calling_module=None, task_function=task,
                  config_path="sphere_conf", config_name=config,
                  overrides=["hydra.job.chdir=False", "hydra.output_subdir=null", *overrides],
                  temp_dir=tmp_path / "sweep")


def results(sweep: Any) -> DictConfig:
    return OmegaConf.load(Path(sweep.temp_dir) / "optimization_results.yaml")


def stored(tmp_path: Path, name: str = "s") -> List[str]:
    """Overrides that keep the study in a journal file (ours: a `storage` without `://`),
    for a look at it afterwards."""
    return [f"hydra.sweeper.storage={tmp_path}/optuna.log", f"hydra.sweeper.study_name={name}"]


def study_of(tmp_path: Path, name: str = "s") -> Any:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return optuna.load_study(study_name=name, storage=JournalStorage(
        JournalFileBackend(str(tmp_path / "optuna.log"))))


def states(study: Any) -> List[TrialState]:
    return [t.state for t in study.trials]


@pytest.mark.parametrize("line, expected", [
    ("key=choice(1,2)", CategoricalDistribution([1, 2])),
    ("key=choice(true, false)", CategoricalDistribution([True, False])),
    ("key=choice('hello', 'world')", CategoricalDistribution(["hello", "world"])),
    ("key=shuffle(range(1,3))", CategoricalDistribution((1, 2))),
    ("key=range(1,3)", IntDistribution(1, 3)),
    ("key=interval(1, 5)", FloatDistribution(1, 5)),
    ("key=int(interval(1, 5))", IntDistribution(1, 5)),
    ("key=tag(log, interval(1, 5))", FloatDistribution(1, 5, log=True)),
    ("key=tag(log, int(interval(1, 5)))", IntDistribution(1, 5, log=True)),
    ("key=range(0.5, 5.5, step=1)", FloatDistribution(0.5, 5.5, step=1)),
    ("key=tag(int, interval(1, 5))", IntDistribution(1, 5)),  # ours, as before
])
def test_the_grammar_reads_as_hydra_optuna_sweeper_reads_it(line, expected) -> None:
    actual = distribution(OverridesParser.create().parse_overrides([line])[0])
    if isinstance(expected, CategoricalDistribution):  # shuffle() reorders the choices
        assert isinstance(actual, CategoricalDistribution)
        assert set(actual.choices) == set(expected.choices)
    else:
        assert actual == expected


@pytest.mark.parametrize("line, says", [
    ("lr=interval(1e-2, 1e-4)", "low end 0.01 is above its high end 0.0001"),
    ("lr=tag(log, interval(0, 1e-2))", "a log scale needs a low end above 0"),
    ("n=tag(log, int(interval(0, 4)))", "a log scale needs a low end above 0"),
    ("n=range(5, 1)", "low end 5 is above its high end 1"),
    ("n=range(1, 9, step=0)", "hydra.sweeper.params: n=range(1, 9, step=0)"),
])
def test_a_search_space_optuna_cannot_sample_is_one_line(line, says) -> None:
    with pytest.raises(SweepError) as refused:
        distribution(OverridesParser.create().parse_overrides([line])[0])
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("with_commandline, trials", [(True, 6), (False, 20)])
def test_a_seeded_tpe_reaches_the_sphere_threshold(hydra_sweep_runner, tmp_path,
                                                   with_commandline, trials) -> None:
    extra = ["x=choice(0, 1, 2)", "y=0"] if with_commandline else []
    with run_sweep(hydra_sweep_runner, tmp_path, *stored(tmp_path),
                   f"hydra.sweeper.n_trials={trials}",
                   "hydra.sweeper.n_jobs=1", "hydra/sweeper/sampler=tpe",
                   "hydra.sweeper.sampler.seed=123", "~z", *extra) as sweep:
        returned = results(sweep)
    study = study_of(tmp_path)
    best = study.best_trial
    assert returned.name == "optuna" and returned.best_value == best.value
    assert returned.best_params.x == best.params["x"]
    if with_commandline:
        assert "y" not in returned.best_params and "y" not in best.params
        assert best.user_attrs["y"] == "0"  # a fixed parameter, as upstream records it
    else:
        assert returned.best_params.y == best.params["y"]
    # hydra-optuna-sweeper's threshold (of 20 trials): the 95th percentile of the best value
    # over 1000 seeds
    assert returned.best_value <= 2.27
    assert states(study) == [TrialState.COMPLETE] * trials
    assert [len(batch) for batch in sweep.returns] == [1] * trials  # one list per batch


@pytest.mark.parametrize("num_trials", [10, 1])
def test_the_grid_sampler_walks_the_grid_once_in_hydras_order(hydra_sweep_runner, tmp_path,
                                                              num_trials) -> None:
    with run_sweep(hydra_sweep_runner, tmp_path, f"hydra.sweeper.n_trials={num_trials}",
                   config="grid") as sweep:
        returned = results(sweep)
        jobs = [r.overrides for batch in sweep.returns for r in batch]
    # x: choice(-1, 1), y: range(-1.0, 1.0, step=1) (its end left out), z: choice(foo, bar)
    grid = [[f"x={x}", f"y={y}", f"z={z}"]
            for x in (-1, 1) for y in (-1.0, 0.0) for z in ("foo", "bar")]
    assert jobs == grid[:min(num_trials, len(grid))]
    if num_trials >= len(grid):
        assert returned.best_value == 1 and abs(returned.best_params.x) == 1
        assert returned.best_params.y == 0
    assert returned.best_params.z in ("foo", "bar")


def dominates(a: List[float], b: List[float]) -> bool:
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


@pytest.mark.parametrize("with_commandline", [True, False])
def test_several_objectives_write_their_pareto_front(hydra_sweep_runner, tmp_path,
                                                     with_commandline) -> None:
    extra = ["x=range(0, 5)", "y=range(0, 3)"] if with_commandline else []
    with run_sweep(hydra_sweep_runner, tmp_path, "hydra/sweeper/sampler=random",
                   "hydra.sweeper.sampler.seed=123", "hydra.sweeper.n_trials=6", *extra,
                   config="multi_objective",
                   task=sphere.binh_and_korn) as sweep:
        returned = results(sweep)
    assert returned.name == "optuna" and "best_value" not in returned
    front = returned.solutions
    assert front and all(len(s["values"]) == 2 for s in front)
    steps = {0} if with_commandline else {0, 0.5}
    for a in front:
        assert a.params.x % 1 in steps and a.params.y % 1 in steps
        assert a["values"] == list(sphere.binh_and_korn(OmegaConf.create(dict(a.params))))
        assert not any(dominates(list(b["values"]), list(a["values"])) for b in front)


def test_a_custom_search_space_suggests_more_parameters(hydra_sweep_runner, tmp_path) -> None:
    with run_sweep(hydra_sweep_runner, tmp_path, "hydra/sweeper/sampler=random",
                   "hydra.sweeper.sampler.seed=123", "max_z_difference_from_x=0.3",
                   "hydra.sweeper.n_trials=6",
                   config="custom_search_space", task=sphere.multi_dimensional_sphere) as sweep:
        returned = results(sweep)
        jobs = [r.cfg for batch in sweep.returns for r in batch]
    best = returned.best_params
    assert abs(best.x - best.z) <= 0.3 and 0 <= best["+w"] <= 1
    assert all(abs(cfg.x - cfg.z) <= 0.3 and 0 <= cfg.w <= 1 for cfg in jobs)


def test_above_the_failure_rate_the_sweep_ends_with_the_jobs_error(hydra_sweep_runner,
                                                                  tmp_path) -> None:
    with pytest.raises(RuntimeError, match="cfg.error is True"):
        with run_sweep(hydra_sweep_runner, tmp_path, *stored(tmp_path), "error=true",
                       "hydra.sweeper.n_jobs=2", "hydra.sweeper.max_failure_rate=0.5",
                       "hydra/sweeper/sampler=random"):
            pass
    assert states(study_of(tmp_path)) == [TrialState.FAIL] * 2  # one batch, then the end


def test_within_the_failure_rate_failed_trials_fail_and_the_sweep_goes_on(hydra_sweep_runner,
                                                                        tmp_path) -> None:
    with run_sweep(hydra_sweep_runner, tmp_path, *stored(tmp_path), "+fail_above=0",
                   "hydra.sweeper.n_trials=6", "hydra.sweeper.n_jobs=2",
                   "hydra.sweeper.max_failure_rate=1.0",
                   "hydra/sweeper/sampler=random") as sweep:
        returned = results(sweep)
    study = study_of(tmp_path)
    assert len(study.trials) == 6 and TrialState.RUNNING not in states(study)
    for trial in study.trials:
        assert trial.state == (TrialState.FAIL if trial.params["x"] > 0 else
                               TrialState.COMPLETE)
    assert returned.best_params.x <= 0


def test_when_every_job_fails_the_sweep_ends_as_the_first_one(hydra_sweep_runner,
                                                             tmp_path) -> None:
    with pytest.raises(RuntimeError, match="cfg.error is True"):
        with run_sweep(hydra_sweep_runner, tmp_path, *stored(tmp_path), "error=true",
                       "hydra.sweeper.n_trials=4", "hydra.sweeper.max_failure_rate=1.0"):
            pass
    assert states(study_of(tmp_path)) == [TrialState.FAIL] * 4  # all of them launched


@pytest.mark.parametrize("rate, trials", [(0.0, 1), (1.0, 3)])
def test_a_jobs_exit_fails_its_trial_and_ends_the_sweep_with_its_code(hydra_sweep_runner,
                                                                      tmp_path, rate,
                                                                      trials) -> None:
    """A job's SystemExit does not pass through the sweeper: the trial fails, the sweep goes
    on as far as max_failure_rate lets it, then ends with the job's own exit code."""
    with pytest.raises(SystemExit) as ended:
        with run_sweep(hydra_sweep_runner, tmp_path, *stored(tmp_path), "+exit_code=1",
                       "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
                       f"hydra.sweeper.max_failure_rate={rate}"):
            pass
    assert ended.value.code == 1
    assert states(study_of(tmp_path)) == [TrialState.FAIL] * trials


@pytest.mark.parametrize("stop", ["+exit_code=75", "+interrupt=true"])
def test_an_interrupted_trial_fails_and_the_same_sweep_runs_it_again(hydra_sweep_runner,
                                                                     tmp_path, stop) -> None:
    """Ctrl-C (or a preempted job, exit 75) stops the sweep at once; its trial is marked
    failed, not left RUNNING, and the same sweep again asks for its parameters first, so
    that job resumes rather than a finished one's parameters coming back."""
    common = [*stored(tmp_path), "hydra.sweeper.n_trials=1", "hydra.sweeper.n_jobs=1"]
    with run_sweep(hydra_sweep_runner, tmp_path, *common):
        pass
    with pytest.raises((SystemExit, KeyboardInterrupt)) as stopped:
        with run_sweep(hydra_sweep_runner, tmp_path, *common, stop):
            pass
    assert getattr(stopped.value, "code", 75) == 75
    study = study_of(tmp_path)  # trial 2: the interrupted one's parameters, queued
    assert states(study) == [TrialState.COMPLETE, TrialState.FAIL, TrialState.WAITING]
    interrupted = study.trials[1].params
    with run_sweep(hydra_sweep_runner, tmp_path, *common):
        pass
    study = study_of(tmp_path)
    assert states(study) == [TrialState.COMPLETE, TrialState.FAIL, TrialState.COMPLETE]
    assert study.trials[2].params == interrupted != study.trials[0].params
    assert study.trials[2].user_attrs["retry_of"] == 1


def test_a_resumed_seeded_study_proposes_new_parameters(hydra_sweep_runner, tmp_path) -> None:
    """The seed alone would make the sampler propose the first sweep's parameters again,
    whose jobs then have nothing left to train."""
    common = [*stored(tmp_path), "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=1",
              "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=123"]
    for _ in range(2):
        with run_sweep(hydra_sweep_runner, tmp_path, *common):
            pass
    proposed = [tuple(t.params.items()) for t in study_of(tmp_path).trials]
    assert len(proposed) == 8 and proposed[4:] != proposed[:4]
    assert not set(proposed[4:]) & set(proposed[:4])


def test_values_reach_the_job_as_written(hydra_sweep_runner, tmp_path) -> None:
    """Strings as they are (`s=plain`, not `s='plain'`), and quoted where Hydra would read
    the bare text as something else."""
    values = ["plain", "1", "true", "null", "a b", "a,b", "it's"]
    with run_sweep(hydra_sweep_runner, tmp_path, "hydra/sweeper/sampler=grid",
                   "hydra.sweeper.sampler.seed=null", "hydra.sweeper.params=null",
                   "+s=choice(plain, '1', 'true', 'null', 'a b', 'a,b', 'it\\'s')",
                   task=lambda cfg: 0.0) as sweep:
        jobs = [r for batch in sweep.returns for r in batch]
    assert [r.cfg.s for r in jobs] == values
    assert jobs[0].overrides[0] == "+s=plain"


def test_best_overrides_run_the_best_job_on_its_own(hydra_sweep_runner, tmp_path) -> None:
    """Without the group option that set up the sweep, the search space or Hydra's keys."""
    with run_sweep(hydra_sweep_runner, tmp_path, "+search=optuna", "z=3",
                   "y=choice(-1, 2)", "hydra.sweeper.n_trials=4") as sweep:
        returned = results(sweep)
    best = list(returned.best_overrides)
    assert "+search=optuna" not in best and "z=3" in best
    assert not [o for o in best if o.startswith("hydra") or "choice" in o]
    with initialize_config_dir(config_dir=str(APP.parent / "sphere_conf"), version_base=None):
        alone = compose(config_name="sphere", overrides=best)
    assert alone.x == returned.best_params.x and alone.y == returned.best_params.y
    assert sphere.sphere(alone) == returned.best_value
    assert not math.isnan(returned.best_value)


@pytest.mark.parametrize("case", ["journal", "directions", "password"])
def test_a_storage_the_sweep_cannot_use_is_one_line(hydra_sweep_runner, tmp_path, capsys,
                                                    case) -> None:
    """(The trainer's own cases, a corrupt, locked or foreign sqlite file and a missing
    driver, are in test_optuna_sweeper_cli.py.) A password holding a `/` (AWS secret keys
    do) is never shown, nor any part of it."""
    journal = tmp_path / "optuna.log"
    storage = stored(tmp_path)
    if case == "journal":
        journal.write_text("{not a journal\n")
    elif case == "directions":
        optuna.create_study(study_name="s", direction="maximize", storage=optuna.storages.
                            JournalStorage(optuna.storages.journal.JournalFileBackend(
                                str(journal))))
    else:
        storage = ["hydra.sweeper.storage=mysql://sweeper:s3/cr3t@127.0.0.1:1/optuna"]
    with pytest.raises(SystemExit) as ended:
        with run_sweep(hydra_sweep_runner, tmp_path, *storage):
            pass
    err = capsys.readouterr().err
    refusal = [line for line in err.splitlines() if line.startswith("error: ")]
    assert ended.value.code == 2 and len(refusal) == 1 and "Traceback" not in err
    assert refusal[0].startswith("error: hydra.sweeper.storage=" if case != "directions" else
                                 "error: hydra.sweeper.direction=['minimize']: study s in ")
    assert "s3" not in err and "cr3t" not in err, refusal


def test_the_study_and_its_results_never_hold_a_password(hydra_sweep_runner, tmp_path) -> None:
    """A fixed override with a URL's password (a data source): the jobs get it as typed; the
    study's stored trials and optimization_results.yaml do not."""
    with run_sweep(hydra_sweep_runner, tmp_path, *stored(tmp_path), "hydra.sweeper.n_trials=2",
                   "+source=http://user:s3cret@127.0.0.1/data") as sweep:
        assert {r.cfg.source for batch in sweep.returns for r in batch} == {
            "http://user:s3cret@127.0.0.1/data"}
        kept = results(sweep)
    assert b"s3cret" not in (tmp_path / "optuna.log").read_bytes()
    assert "s3cret" not in OmegaConf.to_yaml(kept)
    assert "+source=http://127.0.0.1/data" in kept.best_overrides


def test_a_failed_jobs_overrides_are_not_printed(hydra_sweep_runner, tmp_path, capsys) -> None:
    """Hydra prints a failed job's overrides verbatim where its return value is read: a
    password in a URL with them."""
    with pytest.raises(RuntimeError):
        with run_sweep(hydra_sweep_runner, tmp_path, "error=true",
                       "+source=http://user:s3cret@127.0.0.1/data"):
            pass
    assert "s3cret" not in capsys.readouterr().err


def test_the_defaults_are_hydra_optuna_sweepers() -> None:
    """hydra-optuna-sweeper 1.3's defaults (its config.py), Optuna's own for the sampler."""
    with initialize_config_dir(config_dir=str(APP.parent / "sphere_conf"), version_base=None):
        hydra = compose(overrides=["hydra/sweeper=goodput_optuna"],
                        return_hydra_config=True).hydra
    sweeper = OmegaConf.to_container(hydra.sweeper)
    assert {k: sweeper[k] for k in ("direction", "storage", "study_name", "n_trials", "n_jobs",
                                    "max_failure_rate", "params", "custom_search_space")} == {
        "direction": "minimize", "storage": None, "study_name": None, "n_trials": 20,
        "n_jobs": 2, "max_failure_rate": 0.0, "params": None, "custom_search_space": None}
    assert sweeper["sampler"]["_target_"] == "optuna.samplers.TPESampler"
    assert hydra.runtime.choices["hydra/sweeper/sampler"] == "tpe"


def test_the_sweepers_seed_stands_in_for_the_samplers(hydra_sweep_runner, tmp_path) -> None:
    proposed = []
    for seeds in (["hydra.sweeper.sampler.seed=5"],
                  ["hydra.sweeper.sampler.seed=null", "hydra.sweeper.seed=5"]):
        with run_sweep(hydra_sweep_runner, tmp_path, "hydra/sweeper/sampler=random",
                       "hydra.sweeper.n_trials=3", *seeds) as sweep:
            proposed.append([r.overrides for batch in sweep.returns for r in batch])
    assert proposed[0] == proposed[1]


@pytest.mark.parametrize("sampler, built", [
    ("tpe", "TPESampler"), ("random", "RandomSampler"), ("cmaes", "CmaEsSampler"),
    ("nsgaii", "NSGAIISampler"), ("motpe", "TPESampler"), ("grid", "GridSampler")])
def test_each_sampler_of_the_group_builds_with_its_options(hydra_sweep_runner, tmp_path,
                                                           caplog, sampler, built) -> None:
    caplog.set_level(logging.INFO, logger="hydra_plugins.goodput_optuna_sweeper._impl")
    with run_sweep(hydra_sweep_runner, tmp_path, f"hydra/sweeper/sampler={sampler}",
                   "hydra.sweeper.n_trials=2", "x=range(-2, 3)", "y=range(-1, 2)") as sweep:
        returned = results(sweep)
    assert returned.best_value == min(r.return_value for b in sweep.returns for r in b)
    assert any(f"{built} sampler: 2 trials" in r.getMessage() for r in caplog.records
               if r.name.startswith("hydra_plugins.goodput_optuna_sweeper"))
