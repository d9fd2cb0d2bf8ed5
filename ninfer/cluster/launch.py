"""Start and stop the Serve application on a Ray cluster (an existing one, or a local one)."""

from __future__ import annotations

import attrs

from ninfer.cluster.deployments import ClusterOptions, build_app

APP_NAME = "ninfer"


@attrs.frozen(kw_only=True)
class RayOptions:
    address: str | None = None  # None: start a local Ray instance
    num_cpus: int | None = None  # a local instance's logical CPUs (None: Ray counts them)
    object_store_mib: int | None = None  # a local instance's object store (None: Ray's default)
    host: str = "127.0.0.1"
    port: int = 8000


def resolve_backend(options: ClusterOptions) -> ClusterOptions:
    """`auto` resolved on the cluster this process is connected to (`auto_backend`), and one GPU
    per replica for CUDA unless the options ask for another share."""
    import ray

    backend = options.backend
    if backend == "auto":
        backend = auto_backend(ray.cluster_resources().get("GPU", 0) >= 1, options.model)
    gpus = 1.0 if backend == "cuda" and options.num_gpus_per_replica == 0 else options.num_gpus_per_replica
    return attrs.evolve(options, backend=backend, num_gpus_per_replica=gpus)


def auto_backend(cluster_has_gpus: bool, model: str | None) -> str:
    """`auto`: CUDA where the cluster has GPUs, else what `ninfer serve` picks without one
    (`ninfer.runtime.resolve_backend`): the cpu backend for the models it runs, the reference
    backend for the rest (the model's GGUF header or config tells which)."""
    if cluster_has_gpus:
        return "cuda"
    from ninfer.cluster.prompt_keys import load_prompt_model
    from ninfer.runtime import host_backend

    return host_backend(load_prompt_model(model).spec)


def start(options: ClusterOptions, ray_options: RayOptions) -> tuple[ClusterOptions, str]:
    """Connect to (or start) Ray, deploy, wait until every replica is ready; (options as resolved, URL)."""
    import ray
    from ray import serve

    init: dict = {"address": ray_options.address, "include_dashboard": False, "log_to_driver": False}
    if ray_options.address is None:
        init["num_cpus"] = ray_options.num_cpus
        if ray_options.object_store_mib is not None:
            init["object_store_memory"] = ray_options.object_store_mib << 20
    ray.init(**init)
    options = resolve_backend(options)
    serve.start(http_options={"host": ray_options.host, "port": ray_options.port})
    serve.run(build_app(options), name=APP_NAME, route_prefix="/")
    host = f"[{ray_options.host}]" if ":" in ray_options.host else ray_options.host
    return options, f"http://{host}:{ray_options.port}"


def stop() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
