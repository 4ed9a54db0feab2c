"""The trainer's side of checkpoints: when to save, restore and roll back, and the `Stateful`
adapters of what a checkpoint holds."""
