"""Environments behind one contract: gymnax by name, suite adapters, gymnasium, a user's env, transforms."""
