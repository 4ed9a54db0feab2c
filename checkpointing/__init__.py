"""Checkpointing (async DCP, commit protocol, verified resume): see docs/architecture.md."""
