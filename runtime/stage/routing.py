"""MoE routing replay: the routing an F stage used, kept for the recompute of the same layer in a B stage.

`LayerRunner.forward(routing="record")` (an F stage) keeps each MoE layer's routing
(`passes.meta.moe.Routing`: the top-k indices and weights of its routers) in the runtime's `RoutingLog`; the
recompute of that layer in a B stage (`routing="replay"`), on any worker, routes with it, so the backward
differentiates the experts the forward used even when the router's logits differ in the last bit there.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["RoutingLog"]


class RoutingLog:
    """The MoE routing of each (iteration, microbatch, layer) forward, kept for its recompute (module docstring).

    Host workers keep the recorded tensors. CUDA workers copy them to pinned host memory on the
    forward's compute stream and record an event; the recomputing worker's stream waits for that
    event before it copies them in. A recompute whose forward has not run yet waits for it (the
    forward depends on nothing after the recompute), at most `timeout` seconds.
    """

    def __init__(self, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._cond = threading.Condition()
        self._log: dict[tuple, tuple[list, Any]] = {}  # (t, mb, layer) -> (topk outputs, CUDA event or None)

    def put(self, key: tuple, entries: list) -> None:
        """Keep one forward's topk outputs (values, indices) in call order."""
        event = None
        if entries and entries[0][0].is_cuda:
            entries = [(v.to("cpu", non_blocking=True), i.to("cpu", non_blocking=True)) for v, i in entries]
            event = torch.cuda.Event()
            event.record()
        with self._cond:
            self._log[key] = (entries, event)
            self._cond.notify_all()

    def take(self, key: tuple, device: torch.device) -> list:
        """The forward's routing for its recompute on `device` (removed from the log).

        Raises:
            RuntimeError: the forward did not record it within the timeout (names the key).
        """
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._log, timeout=self.timeout):
                raise RuntimeError(f"routing replay: no routing recorded for (iteration, microbatch, layer) "
                                   f"{key} within {self.timeout:.0f}s")
            entries, event = self._log.pop(key)
        if event is None:
            return entries
        torch.cuda.current_stream(device).wait_event(event)
        return [(v.to(device, non_blocking=True), i.to(device, non_blocking=True)) for v, i in entries]

    def forget_from(self, t: int) -> None:
        """Drop the routing of iterations >= t (abandoned after a failure)."""
        with self._cond:
            for k in [k for k in self._log if k[0] >= t]:
                del self._log[k]
