"""What keeps a run alive and its files safe: checkpoints and resume, interrupts, W&B, MHA -> GQA conversion."""
