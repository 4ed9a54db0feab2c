"""A Hydra sweeper on Optuna's own API (`hydra/sweeper=goodput_optuna`).

hydra-optuna-sweeper 1.3 (the release for hydra-core 1.3) pins `optuna<3`, which cannot open
a sqlite study next to the SQLAlchemy 2 that MLflow pulls in; its 1.4 needs hydra-core 1.4,
a pre-release. This one works with current Optuna and keeps that plugin's way of writing a
search space, so a study moves between the two by renaming the sweeper.
"""
