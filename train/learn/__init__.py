"""The step's parts: the model, the optimizer and its schedule, and the strategy that spreads
the model over the ranks (single, ddp, fsdp)."""
