"""Measure the devices at hand (collectives per mesh axis, matmul rate) and write a cluster file
that the planner loads instead of the device table."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from meshplan.errors import MeshError

DEFAULT_SIZES = (1 << 16, 1 << 20, 1 << 23)  # bytes per device per all-reduce
GEMM_SHAPES = ((32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 64, 1024),
               (1024, 1024, 1024))  # (m, n, k) of the GEMM efficiency curve


def _timed(fn, *args, repeats: int) -> float:
    fn(*args).block_until_ready()  # compile and warm up
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - start) / repeats


def measure_all_reduce(mesh, axis: str, nbytes: int, repeats: int) -> float:
    """Seconds for one all-reduce of `nbytes` per device along mesh axis `axis`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    names = mesh.axis_names
    rows = max(1, nbytes // 4 // 256)
    shape = tuple(mesh.shape[n] * (rows if n == names[0] else 1) for n in names) + (256,)
    spec = P(*names, None)
    fn = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, axis), mesh=mesh, in_specs=spec, out_specs=spec))
    x = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, spec))
    return _timed(fn, x, repeats=repeats)


def measure_matmul(size: int = 1024, repeats: int = 5) -> float:
    """Sustained FLOP/s of a square float32 matmul on one device."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.float32)
    seconds = _timed(jax.jit(lambda x: x @ x), a, repeats=repeats)
    return 2 * size**3 / seconds


def measure_gemm(m: int, n: int, k: int, repeats: int = 5) -> float:
    """Sustained FLOP/s of an (m x k) @ (k x n) float32 matmul on one device."""
    import jax
    import jax.numpy as jnp

    a, b = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    seconds = _timed(jax.jit(lambda x, y: x @ y), a, b, repeats=repeats)
    return 2 * m * n * k / seconds


def fit_gemm_curve(shapes: Sequence[tuple[int, int, int]], rates: Sequence[float],
                   peak: float) -> tuple[float, float]:
    """(gemm_max, gemm_half) of meshplan.cost.kernels' curve rate = peak * max * prod x/(x+half)
    that fits measured rates best in log space (half on a grid, max in closed form)."""
    dims = np.array(shapes, dtype=float)
    observed = np.log(np.array(rates, dtype=float) / peak)
    best = None
    for half in np.concatenate([[0.0], np.geomspace(1.0, 8192.0, 400)]):
        shape = np.log(dims / (dims + half)).sum(axis=1)
        log_max = float(np.mean(observed - shape))
        error = float(np.sum((observed - shape - log_max) ** 2))
        if best is None or error < best[0]:
            best = (error, min(1.0, float(np.exp(log_max))), float(half))
    return best[1], best[2]


def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float], devices: int) -> tuple[float, float]:
    """Least-squares alpha (s) and beta (s/byte) of t = alpha + beta * 2(n-1)/n * bytes."""
    x = np.array(sizes, dtype=float) * 2 * (devices - 1) / devices
    a = np.stack([np.ones_like(x), x], axis=1)
    alpha, beta = np.linalg.lstsq(a, np.array(seconds), rcond=None)[0]
    return max(float(alpha), 0.0), max(float(beta), 1e-15)


def profile_cluster(nodes: int, devices_per_node: int, memory_bytes: float, sizes: Sequence[int] = DEFAULT_SIZES,
                    repeats: int = 5, name: str = "measured") -> dict:
    """Measure a nodes x devices_per_node view of the JAX devices; return the cluster file data.

    Axis 0 of the view stands for the links between nodes, axis 1 for links inside a node.
    """
    import jax

    from meshplan.cluster.mesh import LogicalMesh
    from meshplan.runtime.sharded import make_jax_mesh

    count = len(jax.devices())
    if nodes * devices_per_node != count:
        raise MeshError(f"profile-cluster: {nodes}x{devices_per_node} needs {nodes * devices_per_node} devices but "
                        f"JAX sees {count}; pass --nodes and --devices-per-node whose product is {count}")
    mesh = make_jax_mesh(LogicalMesh((nodes, devices_per_node), (0.0, 0.0), (0.0, 0.0)))
    measured, fitted = {}, {}
    for axis, size in zip(mesh.axis_names, (nodes, devices_per_node), strict=True):
        if size < 2:
            continue
        times = [measure_all_reduce(mesh, axis, b, repeats) for b in sizes]
        measured[axis] = {"bytes": list(sizes), "seconds": times}
        fitted[axis] = fit_alpha_beta(sizes, times, size)
    intra = fitted.get(mesh.axis_names[1]) or fitted.get(mesh.axis_names[0]) or (0.0, 1e-12)
    inter = fitted.get(mesh.axis_names[0], intra)
    flops = measure_matmul(repeats=repeats)
    rates = [measure_gemm(*shape, repeats=repeats) for shape in GEMM_SHAPES]
    peak = max(flops, *rates)
    gemm_max, gemm_half = fit_gemm_curve(GEMM_SHAPES, rates, peak)
    flops = peak
    device = {"name": name, "peak_flops": flops, "memory_bytes": memory_bytes,
              "intra_bandwidth": 1 / intra[1], "intra_latency": intra[0],
              "inter_bandwidth": 1 / inter[1], "inter_latency": inter[0],
              "description": f"measured on {count} {jax.devices()[0].platform} devices"}
    return {"nodes": nodes, "devices_per_node": devices_per_node, "device": device,
            # `meshplan simulate --efficiency-file` reads this: the GEMM curve of these devices.
            "kernel_efficiency": {"gemm_max": gemm_max, "gemm_half": gemm_half, "fp8_max": gemm_max},
            "measured": {"all_reduce": measured, "matmul_flops": flops,
                         "gemm": {"shapes": [list(s) for s in GEMM_SHAPES], "flops": rates}}}
