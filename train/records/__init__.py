"""What a run leaves on disk for afterwards: the event timeline, the goodput accounting, and
the goodput report."""
