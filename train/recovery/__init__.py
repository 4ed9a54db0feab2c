"""When a step goes wrong inside a live run: bad-step verdicts, rollbacks, the hang watchdog,
and in-band replica groups (torchft)."""
