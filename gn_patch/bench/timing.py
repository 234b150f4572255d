"""How the benchmark times a call: GPU time by CUDA-graph replay, host time by loops around the call, and
triton's do_bench for the peers' "time a caller sees". Every function here needs a CUDA GPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .results import attempt

# Wall-time loops: enough calls to average out the host clock, few enough to stay cheap (launch-bound shapes
# only, where the GPU keeps up with the host and L2 residency of the inputs cannot change the result).
WALL_MIN_CALLS, WALL_MAX_CALLS = 50, 200


def sync() -> None:
    """Wait for the GPU (torch.cuda.synchronize)."""
    torch.cuda.synchronize()


def warm_up(step: Callable[[int], Any], n_sets: int, calls: int = 3) -> None:
    """``calls`` calls of ``step(i % n_sets)`` on a side stream before capture, as torch.cuda.graph asks (lazy
    initialisation, autotuning, the allocator's pools)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            step(i % n_sets)
    torch.cuda.current_stream().wait_stream(side)
    sync()


def median_event_ms(run: Callable[[], Any], target_ms: float, min_reps: int = 5, max_reps: int = 100) -> float:
    """Median GPU time of ``run()`` in ms between two CUDA events, over as many repetitions (``min_reps`` to
    ``max_reps``) as fill about ``target_ms`` of GPU time."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    sync()
    reps = int(min(max_reps, max(min_reps, target_ms / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        run()
        end.record()
    sync()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def gpu_time_us(step: Callable[[int], Any], n_sets: int, target_ms: float, eager_fallback: bool = True
                ) -> tuple[float, str]:
    """GPU time of one call in µs, and how it was taken ("graph", or "events (<exception type>)").

    ``step(0) ... step(n_sets - 1)`` (one pass over a rotation pool, or n_sets calls on the same inputs) are
    captured in one CUDA graph, which is replayed: the median replay time divided by n_sets is the GPU time
    without launch overhead. Calls that cannot be captured are timed with CUDA events around the eager loop, or
    without ``eager_fallback`` raise what the capture raised.
    """
    warm_up(step, n_sets)
    graph = torch.cuda.CUDAGraph()

    def capture() -> None:
        with torch.cuda.graph(graph):
            for i in range(n_sets):
                step(i)

    if not eager_fallback:
        capture()
        return median_event_ms(graph.replay, target_ms) * 1e3 / n_sets, "graph"
    _, error = attempt(capture)  # whatever the call does that capture forbids: time it eagerly instead
    if error is not None:
        sync()
        how = f"events ({error.split(':')[0]})"
        return median_event_ms(lambda: [step(i) for i in range(n_sets)], target_ms) * 1e3 / n_sets, how
    return median_event_ms(graph.replay, target_ms) * 1e3 / n_sets, "graph"


def graph_replay_ms(call: Callable[[], Any], target_ms: float = 50.0) -> float:
    """GPU time in ms of one call replayed from a CUDA graph: its kernels without the host's launch gaps.

    Raises whatever capture raises (a call that synchronizes, allocates outside the graph pool, ...).
    """
    warm_up(lambda _: call(), 1, calls=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return median_event_ms(graph.replay, target_ms)


def host_loop_us(step: Callable[[int], Any], n_sets: int, calls: int, rounds: int, wait: bool) -> list[float]:
    """Host µs per call of a Python loop of ``calls`` calls of ``step(i % n_sets)``, one value per round.

    ``wait``: the timed region ends with torch.cuda.synchronize() (what an eager caller pays until the results
    exist); else only the loop is timed (the host cost of launching) and the GPU drains between rounds, untimed.
    """
    per_call = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for i in range(calls):
            step(i % n_sets)
        if wait:
            sync()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    sync()
    return per_call


def wall_time_us(step: Callable[[int], Any], n_sets: int, rounds: int) -> float:
    """Median host µs per call of an eager loop over the pool, synchronized at both ends: what an eager caller
    pays (WALL_MIN_CALLS to WALL_MAX_CALLS calls per round)."""
    calls = min(max(n_sets, WALL_MIN_CALLS), WALL_MAX_CALLS)
    return statistics.median(host_loop_us(step, n_sets, calls, rounds, wait=True))


def time_calls(call: Callable[[], Any], warmup: int, repeats: int, graph: bool = False) -> dict:
    """One end-to-end cell: wall time (host clock around call + synchronize) and GPU time (CUDA events around
    the call), in ms, medians of ``repeats`` calls after ``warmup`` (>= 1; the first call is timed apart, in s:
    compile time for compiled variants); the peak memory allocated during the timed calls and what was allocated
    before them (weights, inputs), in MiB; with ``graph`` the CUDA-graph replay time of the call (``graph_ms``) or
    why it could not be captured (``graph_error``)."""
    sync()
    start = time.perf_counter()
    call()
    sync()
    first_call_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        call()
    sync()
    torch.cuda.reset_peak_memory_stats()
    resident_mb = torch.cuda.memory_allocated() / 2**20
    walls, gpus = [], []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync()
        start = time.perf_counter()
        begin.record()
        call()
        end.record()
        sync()
        walls.append((time.perf_counter() - start) * 1e3)
        gpus.append(begin.elapsed_time(end))
    result = {"wall_ms": round(statistics.median(walls), 3), "gpu_ms": round(statistics.median(gpus), 3),
              "peak_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1), "resident_mb": round(resident_mb, 1),
              "first_call_s": round(first_call_s, 2), "warmup": warmup, "repeats": repeats}
    if graph:
        graph_ms, error = attempt(lambda: graph_replay_ms(call))  # the eager times stand without it
        if error is None:
            result["graph_ms"] = round(graph_ms, 3)
        else:
            sync()
            result["graph_error"] = error
    return result


def do_bench_us(call: Callable[[], Any]) -> float:
    """Median µs of ``call()`` by triton.testing.do_bench (L2 flushed between repetitions): the time a caller
    sees, host cost included where it exceeds the GPU work. Raises ImportError without triton."""
    from triton.testing import do_bench

    return do_bench(call, return_mode="median") * 1e3
