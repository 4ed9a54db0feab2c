"""Small utilities that `train`, `data` and `checkpointing` share, each written once.

This package imports none of those three (they may all import it), and needs only the
standard library, plus torch for `common.distributed`.
"""
