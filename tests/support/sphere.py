"""A tiny Hydra app for the Optuna sweeper's tests, after hydra-optuna-sweeper's examples:
the sphere x² + y² (`sphere`), the two objectives of Binh and Korn (`binh_and_korn`), and a
custom search space (`configure`). Its configs are in sphere_conf/."""

from typing import Tuple

import hydra
from omegaconf import DictConfig


def sphere(cfg: DictConfig) -> float:
    """x² + y²; `error=true` fails every job, `fail_above=v` the jobs whose x is above v,
    `exit_code=n` ends every job with SystemExit(n) (as the trainer ends a failed run),
    `interrupt=true` stops it as Ctrl-C does."""
    if cfg.get("error", False):
        raise RuntimeError("cfg.error is True")
    if cfg.get("fail_above") is not None and cfg.x > cfg.fail_above:
        raise RuntimeError(f"x={cfg.x} is above {cfg.fail_above}")
    if cfg.get("exit_code") is not None:
        raise SystemExit(cfg.exit_code)
    if cfg.get("interrupt", False):
        raise KeyboardInterrupt
    return cfg.x ** 2 + cfg.y ** 2


def binh_and_korn(cfg: DictConfig) -> Tuple[float, float]:
    return 4 * cfg.x ** 2 + 4 * cfg.y ** 2, (cfg.x - 5) ** 2 + (cfg.y - 5) ** 2


def multi_dimensional_sphere(cfg: DictConfig) -> float:
    return cfg.w ** 2 + cfg.x ** 2 + cfg.y ** 2 + cfg.z ** 2


def configure(cfg: DictConfig, trial) -> None:
    """`hydra.sweeper.custom_search_space`: z within `max_z_difference_from_x` of x, and a
    new key w."""
    x = trial.params["x"]
    trial.suggest_float("z", x - cfg.max_z_difference_from_x, x + cfg.max_z_difference_from_x)
    trial.suggest_float("+w", 0.0, 1.0)


@hydra.main(version_base=None, config_path="sphere_conf", config_name="sphere")
def main(cfg: DictConfig) -> float:
    return sphere(cfg)


if __name__ == "__main__":
    main()
