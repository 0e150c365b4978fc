"""Program: the per-iteration instruction list of the RoundPipe schedule (the emit IR).

# IR READY  (data model stable: fields and methods may be added, never renamed or removed)

A Program is one iteration of training as plain data: every transfer, compute,
optimizer step and copy as an `Instr`, each with explicit completion
dependencies (`Ref`). Per (worker, lane) the instructions execute one at a time
in the order they appear in `instrs` (FIFO); that order is how priority and
packing are expressed.

Text grammar of an instruction name (`Instr.name`):

    worker  := "w" INT | "h"                         (h = host, worker -1)
    name    := worker " " OP STAGE ".m" MB ["g"]     U F X R B D   ("g": the U of a B slot's input gradient)
             | worker " " OP STAGE ".r" ROUND ".c" CHUNK   P G
             | worker " " "E" STAGE ".r" ROUND               E
             | "h " OP ".l" LAYER                          O C
    dep     := name ["@-" BACK] ["[t>=" SINCE "]"]
    instr   := name [" <- " dep ("," dep)*]

    >>> i = Instr.from_str("w3 B5.m2 <- w3 R5.m2,w2 D4.m2")
    >>> i.op, i.worker, i.stage, i.mb, i.lane.value, i.name
    (<Op.BACKWARD: 'B'>, 3, 5, 2, 'compute', 'w3 B5.m2')

Note: resolving a `Ref` in iteration t. A Ref names an instruction exactly as
it appears in the SAME program's `instrs` (template numbering) and `back` says
which iteration's instance: the instance of `name` in iteration t - back. The
Ref is vacuous (ignored) when t - back < 0 (initial weights, empty buffers) or
when t < since (used by staleness 1, where iterations 0 and 1 both read the
initial weights). Iteration t runs the template with every worker id w mapped to
the physical worker (w + t * (next_offset - worker_offset)) mod gpus; host
instructions (worker -1) are not remapped. A physical lane runs iteration t's
instructions before iteration t+1's. `shifted(k)` renames the workers of
instructions AND refs uniformly, so the same resolution rule applies to it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from rpcompile.ir import program_io
from rpcompile.ir.instr import (CHUNK_OPS, COMPUTE_OPS, HOST_OPS, LANE_OF, MB_OPS, Chunk, Instr, Lane, Op,
                                ProgramError, Ref)
from rpcompile.ir.plan import StagePlan

# the instruction records are defined in instr.py and re-exported here, beside the Program that holds them
__all__ = ["Program", "Op", "Instr", "Ref", "Chunk", "Lane", "ProgramError", "LANE_OF", "HOST_OPS", "MB_OPS",
           "COMPUTE_OPS", "CHUNK_OPS"]


@dataclass(frozen=True, slots=True)
class Program:
    """One iteration of the RoundPipe schedule; a template for every iteration (see module Note).

    >>> from rpcompile.passes import emit
    >>> p = emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2)
    >>> p.by_name()["w0 R2.m0"].deps[0].name
    'w0 P2.r0.c0'
    """

    plan: StagePlan
    gpus: int
    microbatches: int
    round_size: int
    staleness: int
    worker_offset: int          # g0 of this iteration (0 for the first)
    next_offset: int            # g0 of the next iteration: (worker_offset + S*rounds) % gpus
    instrs: tuple[Instr, ...]   # one iteration, in a valid topological order; per lane = execution order
    chunks: tuple[Chunk, ...]   # parameter/gradient chunks per stage (same for P and G)
    # Tied parameters: (optimizer layer l, every layer whose uploads read / downloads write group l),
    # only for groups read by more than layer l itself. Empty: group l = layer l.
    readers: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def rounds(self) -> int:
        return self.microbatches // self.round_size

    @property
    def shift(self) -> int:
        """Worker rotation from one iteration to the next (mod gpus)."""
        return (self.next_offset - self.worker_offset) % self.gpus

    def by_name(self) -> dict[str, Instr]:
        """{instr.name: instr}."""
        return {i.name: i for i in self.instrs}

    def index(self) -> dict[str, int]:
        """{instr.name: position in instrs}."""
        return {i.name: k for k, i in enumerate(self.instrs)}

    def lanes(self) -> dict[tuple[int, Lane], list[Instr]]:
        """{(worker, lane): [instr, ...]} in execution order (host worker = -1)."""
        out: dict[tuple[int, Lane], list[Instr]] = {}
        for i in self.instrs:
            out.setdefault((i.worker, i.lane), []).append(i)
        return out

    def group_readers(self, layer: int) -> tuple[int, ...]:
        """Layers whose P/G chunks read/write optimizer group `layer` (itself, plus tied users)."""
        return tuple(sorted({layer, *dict(self.readers).get(layer, ())}))

    def groups_of(self, layer: int) -> tuple[int, ...]:
        """Optimizer groups (layers) that a chunk piece of `layer` reads/writes."""
        return tuple(sorted({layer} | {l for l, rs in self.readers if layer in rs}))

    def stage_chunks(self, stage: int) -> tuple[Chunk, ...]:
        """The chunks of `stage`, by index."""
        return tuple(c for c in self.chunks if c.stage == stage)

    def chunk_of(self, instr: Instr) -> Chunk:
        """The Chunk a P or G instruction carries."""
        return next(c for c in self.chunks if c.stage == instr.stage and c.index == instr.chunk)

    def shifted(self, k: int) -> "Program":
        """The program of the iteration k later: worker ids of instrs and refs moved by k*shift.

        >>> from rpcompile.passes import emit
        >>> p = emit(StagePlan.from_str("1|1|1"), gpus=2, microbatches=2)
        >>> p.shifted(1).instrs[0].name, p.shifted(1).worker_offset
        ('w1 P0.r0.c0', 1)
        """
        s = (k * self.shift) % self.gpus
        return replace(self, worker_offset=(self.worker_offset + s) % self.gpus,
                       next_offset=(self.next_offset + s) % self.gpus,
                       instrs=tuple(i.with_worker(s, self.gpus) for i in self.instrs))

    def grid(self, mark: str | None = None, context: int | None = None) -> str:
        """Steps (rows) by worker (columns, host last); `mark` is shown as >>name<<.

        Args:
            mark: an instruction name to highlight.
            context: with `mark`, show only this many rows either side of it.
        """
        return program_io.grid(self, mark=mark, context=context)

    def __str__(self) -> str:
        return self.grid()

    def to_csv(self, path) -> None:
        """Write a lossless CSV (meta, chunks, instructions with deps)."""
        program_io.to_csv(self, path)

    @classmethod
    def from_csv(cls, path) -> "Program":
        """Read `to_csv` output back (equal to the original)."""
        return cls(**program_io.read_csv(path))

    def to_chrome_trace(self, path, timeline=None) -> None:
        """Write chrome://tracing JSON, one event per instruction.

        Args:
            path: output file.
            timeline: None (unit-time placeholders: each instruction lasts 1 us after its deps and
                lane predecessor), a mapping name -> (start, end) in seconds, or an object with
                `start` and `end` mappings name -> seconds.
        """
        program_io.to_chrome_trace(self, path, timeline)
