"""A support agent that refunds orders, asking a human first above a threshold."""
