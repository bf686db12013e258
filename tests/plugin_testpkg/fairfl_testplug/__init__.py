"""FairFL plug-ins defined outside the fairfl package, using only `fairfl.api` (issue #19's acceptance test).

- `models:small_mlp`: a model factory with declared Params.
- `data:Digits`: a Dataset (scikit-learn's bundled 8x8 digits: no network, the same arrays in every process).
- `sampling:RoundRobin`: a sampler with declared Params, selecting a rotating window of the candidates.
- `strategy:CoordinateMedian`: coordinate-wise median aggregation with its own client-side procedure
  (`strategy:UpdateNorm`), whose metrics every client reports and the strategy records in its round metrics.

Named by `fairfl_testplug.<module>:<attr>` (this directory on PYTHONPATH) or, once the `fairfl-testplug` distribution
(pyproject.toml beside this package) is installed, by its entry-point names.
"""
