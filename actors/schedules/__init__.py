"""The schedule kind: an actor that starts its agent's runs on a clock."""
