"""FairFL's built-in aggregation strategies, one module each.

Each is registered as an entry point of group `fairfl.strategies` in pyproject.toml, the same way a third-party
strategy is, and found by `strategy.name` through `fairfl.strategy.STRATEGIES`; no list of them is kept here.
"""
