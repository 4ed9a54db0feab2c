"""What a run tells MLflow and the screen: the tracker, a sweep's parent run and record, what
the store did not take yet, and the progress bar."""
