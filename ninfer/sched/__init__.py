"""The scheduler: admission, execution lanes, the step task, pause / resume, statistics.

`engine.open_engine` is the entry point (`config.EngineConfig`, `request.GenerationRequest`,
`stream.RequestStream`, `stats.EngineStatistics`); `planner` holds the pure decisions,
`fake` and `simulate` a cost-model runner for tests and `ninfer simulate`.
Nothing here imports numba or `ninfer.gpu`: the runner is reached only through the
`ninfer.core.runner.Runner` protocol, the prefix cache through `prefix_hook.PrefixCacheHook`.
"""
