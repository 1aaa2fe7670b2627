"""Routing by work: the rule, the board every instance shares, and an instance's side of it."""
