"""Engine types every layer shares, and nothing else: the neutral bottom of the import graph.

- `params`: `SamplingParams` and the limits a request is checked against (`MAX_TOP_LOGPROBS`).
- `usage`: `Usage` and `Timings`, what a finished request reports.
- `runner`: the `Runner` protocol between the scheduler and a compute backend, with its step
  vocabulary (`StepRow`, `SampleSpec`, `SampledToken`, `PageSnapshot`, `Pending`).

It imports no other part of ninfer but `ninfer.models.spec` (a runner names its model's
shapes), and no numba: `tests/test_layers.py` holds every package to its layer.
"""
