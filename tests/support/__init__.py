"""Helpers shared by the test modules, each defined once: `runs` (the tiny dataset's runs and
configs), `launch` (the one way to start the trainer or torchrun in a subprocess, and to find,
wait for and kill its processes), `ledger` (reading the audit ledger, and the proof that a
restart resumed), `checkpoints` (reading, comparing and damaging checkpoints) and `mount` (a
real FUSE network volume)."""
