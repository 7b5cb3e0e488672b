"""A training run around the compiled program: the loop, the run folder, checkpoints, logs, plots, policy, export, video."""
