"""The retention kind: one pruner per agent with a retention policy, pruning its ended runs."""
