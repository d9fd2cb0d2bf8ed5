"""The scheduler: admission, execution lanes, the step task, pause / resume, statistics.

`engine.open_engine` is the entry point (`config.EngineConfig`, `request.GenerationRequest`,
`stream.RequestStream`, `stats.EngineStatistics`); `planner` holds the pure decisions,
`fake` and `simulate` a cost-model runner for tests and `ninfer simulate`.
Nothing here imports numba: the runner is reached only through `ninfer.gpu.runner.Runner`.
"""
