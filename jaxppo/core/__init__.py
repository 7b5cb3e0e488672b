"""The PPO algorithm as pure functions of arrays: networks, GAE, losses, running statistics, the iteration."""
