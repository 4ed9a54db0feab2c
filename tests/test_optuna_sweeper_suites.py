"""Hydra's own test suites for sweeper plugins, run against `hydra/sweeper=goodput_optuna`,
as Hydra's example sweeper plugin runs them. Their jobs are expected in the basic sweeper's
order, each combination once (an empty search space: one job): a grid, so they run with
the grid sampler, whose order without a seed is the basic sweeper's. The batches run under
joblib too: each job in a process of its own."""

import pytest
from hydra import version
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.test_utils.launcher_common_tests import (BatchedSweeperTestSuite,
                                                    IntegrationTestSuite, LauncherTestSuite)

pytest.importorskip("optuna", reason="pip install '.[sweep]'")

SWEEPER = ["hydra/sweeper=goodput_optuna", "hydra/sweeper/sampler=grid"]


@pytest.fixture(autouse=True)
def hydra_compat_defaults(hydra_restore_singletons) -> None:
    """The suites expect the defaults of an app without a version_base (a job changes into
    its directory); a test before them in this process may have set another one."""
    version.setbase("1.1")


def test_discovery() -> None:
    assert "OptunaSweeper" in [p.__name__ for p in Plugins.instance().discover(Sweeper)]


@pytest.mark.parametrize("launcher_name, overrides", [("basic", SWEEPER)])
class TestOptunaSweeper(LauncherTestSuite):
    ...


@pytest.mark.parametrize("launcher_name, overrides",
                         [("basic", [*SWEEPER, "hydra.sweeper.n_jobs=2"]),
                          ("joblib", [*SWEEPER, "hydra.sweeper.n_jobs=2"])])
class TestOptunaSweeperWithBatching(BatchedSweeperTestSuite):
    ...


@pytest.mark.parametrize("task_launcher_cfg, extra_flags",
                         [({}, ["-m", *SWEEPER, "hydra/launcher=basic"])])
class TestOptunaSweeperIntegration(IntegrationTestSuite):
    ...
