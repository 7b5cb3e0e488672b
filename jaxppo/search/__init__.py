"""Hyperparameter search: the search space, the sweep record, PBT, the results, Ray Tune."""
