"""Replicas behind one endpoint: prefix-aware routing (pure), its virtual-time simulation, and
the Ray Serve application that runs one ninfer engine per replica (docs/cluster.md).

Only `routing`, `prompt_keys` (route keys from request bodies), `metrics_text` and `simulate` are
importable without Ray; `deployments` and
`router` import `ray` and are loaded by `ninfer cluster` alone.
"""
