"""Checkpointing (async DCP, commit protocol, verified resume): see DESIGN.md."""
