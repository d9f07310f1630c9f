"""Training: models, schedules, the S-SGD and SMA engines, checkpoints, evaluation."""
