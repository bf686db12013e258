"""A user's robust-aggregation strategy for FairFL, named as `robust_aggregation.strategy:CoordinateMedian`."""
