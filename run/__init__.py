"""A run's upkeep: settings, checkpoints and resume, interrupts, DDP, AdamW, W&B, conversion."""
