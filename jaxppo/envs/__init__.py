"""Environments behind one contract: gymnax by name, suite adapters, gymnasium and envpool
(host loop), a user's env, transforms."""
