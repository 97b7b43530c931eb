"""Device time of CUDA-graph replays from CUDA events, shared by the bench scripts that need it."""
import torch


def replays_device_us(graph, n: int) -> float:
    """Device µs per replay of ``graph``, from two events around ``n`` back-to-back replays
    (the caller warms the graph up first)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / n
