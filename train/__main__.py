"""Entry point: `python -m train +experiment=resnet [key=value ...]` (add `-m` to sweep).

Under torchrun every rank runs this with the same arguments (train/launch.py).
"""

import sys

import hydra
from omegaconf import DictConfig

from train.config import register_configs, validate
from train.errors import EXIT_CONFIG, ConfigError
from train.launch import refuse_multirun_under_torchrun

register_configs()

# Hydra ends with exit code 1 both when composing fails (a misspelt key, a bad type, an
# unknown config group option: the user must fix it) and when the task fails (possibly
# retryable). Only the first happens before the task function is entered.
_entered = False


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    global _entered
    _entered = True
    refuse_multirun_under_torchrun()
    try:
        validate(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    from train.app import run  # torch and friends load after the config is known to be good

    run(cfg)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exit_:
        if exit_.code == 1 and not _entered:
            raise SystemExit(EXIT_CONFIG) from None
        raise
