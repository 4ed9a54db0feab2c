"""Entry point: `python -m train +experiment=resnet [key=value ...]` (add `-m` to sweep).

Under torchrun every rank runs this with the same arguments (train/launch.py).
"""

import hydra
from omegaconf import DictConfig

from train.config import register_configs
from train.launch import refuse_multirun_under_torchrun

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    refuse_multirun_under_torchrun()
    from train.app import run  # torch and friends load after the config is known to be good

    run(cfg)


if __name__ == "__main__":
    main()
