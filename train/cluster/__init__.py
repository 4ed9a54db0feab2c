"""The job's place on the cluster: process groups, SLURM and torchrun, per-rank directories,
the run lock, the pre-flight and the stop signals the scheduler sends."""
