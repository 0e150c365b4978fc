"""The compute handlers: F, X, R and B run a stage's layers on its worker's compute stream (DESIGN.md 3a).

`ComputeHandlers` is a mixin of `IssueHandlers` (`runtime/handlers.py`), which
owns the tables and the slot helpers these handlers use and holds the transfer
handlers (P, U, D, G, E) and the dispatch table. A compute handler takes its
uploaded inputs, submits one closure that runs the stage's layers (forward,
forward + loss + backward, recompute, backward) with its `LayerRunner`, and
leaves what the download sends in a `Cell`; the tracked buffers (running
statistics) of a training forward's layers form a chain on the board.
"""
from __future__ import annotations

import torch

from rpcompile.runtime.stage.cuts import grads_of
from rpcompile.runtime.stage.hits import HITS
from rpcompile.runtime.streams.devices import saved_tensors_bytes, tensor_bytes
from rpcompile.runtime.streams.values import Cell

__all__ = ["ComputeHandlers"]


class ComputeHandlers:
    """Mixin of `IssueHandlers`: the handlers of the compute Ops (F, X, R, B) and their compute-stream helpers.

    Reads and changes the tables and parts `IssueHandlers` holds (its docstring): graph, io, runners,
    workers, tracked, board, its, and the tables slots (a compute's event as the slot's last
    "compute"), outs (the Cell a download takes), rc (a recompute's graph for its backward); uses
    its helpers `_slot`, `_grads`, `_take_inputs` and `_give`.
    """

    # -- helpers on the compute stream -------------------------------------------------------------
    def _compute(self, t: int, ins, w: int, fn, label: str) -> tuple:
        """Submit compute `fn` on the worker's compute stream; returns its event."""
        cs = self.workers[w].streams["compute"]
        cs.submit(fn, label, t)
        ev = cs.record(t, label)
        self.slots[(t, ins.stage, ins.mb // self.its.program_of(t).round_size)].last["compute"] = ev
        return ev

    def _chain(self, t: int, ins, w: int) -> dict:
        """The tracked buffers (running statistics) of the stage's layers, for a forward that updates them.

        Each such layer's forwards form a chain in eager order (microbatch by microbatch, iteration by
        iteration): this one's stream waits for the previous one, which wrote the host copies back.
        Evaluation reads them without writing back, and needs no chain.
        """
        layers = [l for l in self.io[ins.stage].layers if l in self.tracked]
        if not layers or self.its.info_of(t).forward_only:
            return {l: self.tracked[l] for l in layers}
        cs, m = self.workers[w].streams["compute"], self.its.program_of(t).microbatches
        prev = (t, ins.mb - 1) if ins.mb > 0 else (t - 1, m - 1)
        for l in layers:
            if prev[0] >= self.its.first:
                for ev in self.board.get((prev[0], f"chain {l}.m{prev[1]}"), t, self.its.label(t, ins, w)):
                    cs.wait(ev, t)
        return {l: self.tracked[l] for l in layers}

    def _chained(self, t: int, ins, ev) -> None:
        """Publish this forward as the tracked-buffer chain's latest member."""
        if not self.its.info_of(t).forward_only:
            for l in self.io[ins.stage].layers:
                if l in self.tracked:
                    self.board.publish((t, f"chain {l}.m{ins.mb}"), (ev,))

    # -- the compute handlers: F, X, R, B ----------------------------------------------------------
    def _forward(self, t: int, ins, w: int) -> tuple:
        """F: forward of the stage's layers (no autograd); what the download sends goes to a Cell.

        On the fused stage of a forward-only program (evaluation) it runs through the loss.
        """
        io, worker = self.io[ins.stage], self.workers[w]
        inputs, cell = self._take_inputs(t, ins), Cell()
        slot = self._slot(t, ins.stage, ins.mb // self.its.program_of(t).round_size, w, worker.streams["compute"])
        runner, loss_only = self.runners[w], io.kind.value == "FB"
        bufs, keep = self._chain(t, ins, w), not self.its.info_of(t).forward_only

        def run() -> None:
            env_in = {n: h.get() for n, h in inputs.items()}
            with torch.no_grad():
                env = runner.forward(io.layers, slot.params, env_in, t, ins.mb, buffers=bufs, keep=keep,
                                     routing="record" if keep and not loss_only else None)  # for the recompute
            out = {"loss": env[self.graph.loss]} if loss_only else \
                {"vals": _private({n: env[n] for n in io.down}, env_in)}
            if loss_only and HITS in env:  # evaluation: the (right, counted) predictions go down beside the loss
                out["hits"] = env[HITS]
            worker.store.add(tensor_bytes(out))
            cell.set(out)
        return self._launch(t, ins, w, run, cell, inputs.values())

    def _launch(self, t: int, ins, w: int, run, cell: Cell, used, *, chain: bool = True) -> tuple:
        """Queue `run` on worker w's compute stream (after the previous stage when `chain`), give the `used`
        buffers back to the pool after it, and keep `cell` as the instruction's outputs."""
        ev = self._compute(t, ins, w, run, self.its.label(t, ins, w))
        if chain:
            self._chained(t, ins, ev)
        self._give(self.workers[w].pool, used, [ev])
        self.outs[(t, ins.stage, ins.mb)] = cell
        return (ev,)

    def _fused(self, t: int, ins, w: int) -> tuple:
        """X: forward through the loss and backward (grad_output = loss scale x the microbatch's weight, 1 / M
        unless token weighting gave it one); input grads and loss to a Cell.

        A microbatch of weight 0 (token weighting: no trained token, so its mean loss is 0/0 = NaN) runs
        its forward but no backward: its input gradients are zeros, its parameters get nothing, and its
        loss goes down as 0 (0 x NaN would still be NaN).
        """
        io, worker = self.io[ins.stage], self.workers[w]
        cs = worker.streams["compute"]
        inputs, cell = self._take_inputs(t, ins), Cell()
        slot = self._slot(t, ins.stage, ins.mb // self.its.program_of(t).round_size, w, cs)
        self._grads(t, ins, w, slot, cs)
        runner, scale = self.runners[w], self.its.grad_factor(t, ins.mb)
        bufs = self._chain(t, ins, w)

        def run() -> None:
            env_in = {n: h.get() for n, h in inputs.items()}
            with torch.enable_grad(), saved_tensors_bytes(worker.store, slot.params, env_in) as ws:
                env = runner.forward(io.layers, slot.params, env_in, t, ins.mb, grad_of=io.grad_out, buffers=bufs)
                loss = env[self.graph.loss]
                if scale != 0.0:
                    loss.backward(torch.full_like(loss, scale))
            worker.store.add(-ws[0])
            loss = loss.detach() if scale != 0.0 else torch.zeros_like(loss.detach())
            out = {"grads": _private(grads_of(env, io.grad_out, {}), env_in), "loss": loss}
            worker.store.add(tensor_bytes(out))
            cell.set(out)
        return self._launch(t, ins, w, run, cell, inputs.values())

    def _recompute(self, t: int, ins, w: int) -> tuple:
        """R: forward again from the saved input, same RNG seeds as the forward; the graph goes to a Cell."""
        io, worker = self.io[ins.stage], self.workers[w]
        inputs, cell = self._take_inputs(t, ins), Cell()
        slot = self._slot(t, ins.stage, ins.mb // self.its.program_of(t).round_size, w, worker.streams["compute"])
        runner = self.runners[w]

        def run() -> None:
            env_in = {n: h.get() for n, h in inputs.items()}
            with torch.enable_grad(), saved_tensors_bytes(worker.store, slot.params, env_in) as ws:
                env = runner.forward(io.layers, slot.params, env_in, t, ins.mb, grad_of=io.grad_out,
                                     routing="replay")  # the experts the forward chose
            cell.set((env, ws[0]))
        ev = self._compute(t, ins, w, run, self.its.label(t, ins, w))
        self.rc[(t, ins.stage, ins.mb)] = (cell, inputs)
        return (ev,)

    def _backward(self, t: int, ins, w: int) -> tuple:
        """B: backward from the received output gradients; parameter grads accumulate in the slot's buffers."""
        io, worker = self.io[ins.stage], self.workers[w]
        cs = worker.streams["compute"]
        (rc, saved), gin = self.rc.pop((t, ins.stage, ins.mb)), self._take_inputs(t, ins, grad=True)
        slot = self._slot(t, ins.stage, ins.mb // self.its.program_of(t).round_size, w, cs)
        self._grads(t, ins, w, slot, cs)
        cell = Cell()

        def run() -> None:
            env, ws = rc.get()
            g = {n: h.get() for n, h in gin.items()}
            env_saved = {n: h.get() for n, h in saved.items()}
            outs = [(env[n], g[n]) for n in io.grad_in if n in env and env[n].requires_grad]
            if outs:
                torch.autograd.backward([o for o, _ in outs], [x for _, x in outs])
            worker.store.add(-ws)
            out = {"grads": _private(grads_of(env, io.grad_out, g), {**g, **env_saved})}
            worker.store.add(tensor_bytes(out))
            cell.set(out)
        return self._launch(t, ins, w, run, cell, list(saved.values()) + list(gin.values()), chain=False)


def _private(values: dict, inputs: dict) -> dict:
    """`values` with every tensor that shares storage with an input buffer cloned.

    A layer may pass an input through unchanged (an identity output, or a gradient passed
    through), so an output can be the very pool buffer of an upload. That buffer goes back to the
    pool once the compute is done, and the next upload may overwrite it before the download of
    this output has read it: the download must read a copy of its own.
    """
    taken = {v.untyped_storage().data_ptr() for v in inputs.values() if isinstance(v, torch.Tensor)}
    return {n: v.clone() if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in taken else v
            for n, v in values.items()}
