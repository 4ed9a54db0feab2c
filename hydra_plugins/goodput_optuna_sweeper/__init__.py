"""A Hydra sweeper on Optuna's own API (`hydra/sweeper=goodput_optuna`), a drop-in for
hydra-optuna-sweeper 1.3: its config (config.py: the keys, their defaults, the
`hydra/sweeper/sampler` group) and its grammar for a search space, on current Optuna.

hydra-optuna-sweeper 1.3 (the release for hydra-core 1.3) pins `optuna<3`, which cannot open
a sqlite study next to the SQLAlchemy 2 that MLflow pulls in; its 1.4 needs hydra-core 1.4,
a pre-release. A study moves between the two by renaming the sweeper.
"""
