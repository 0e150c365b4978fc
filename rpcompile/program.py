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

import enum
import re
from dataclasses import dataclass, replace

from rpcompile.plan import StagePlan


class Op(str, enum.Enum):
    """Instruction kinds; the value is the letter used in the compact text."""

    PARAM_UP = "P"    # host->device: one parameter chunk of a stage slot          "w3 P5.r0.c1"
    ACT_UP = "U"      # host->device: input of microbatch m (activation / saved input / gradient "g")  "w3 U5.m2"
    FORWARD = "F"     # forward of a forward stage                                 "w3 F1.m2"
    FUSED = "X"       # forward+backward of the fused stage                        "w3 X4.m2"
    RECOMPUTE = "R"   # forward again from the saved input (B stages)              "w3 R5.m2"
    BACKWARD = "B"    # backward (B stages)                                        "w3 B5.m2"
    ACT_DOWN = "D"    # device->host: outputs of m (activation + saved inputs, or input gradient)  "w3 D5.m2"
    GRAD_DOWN = "G"   # device->host: one gradient chunk of a stage slot           "w3 G5.r0.c1"
    RELEASE = "E"     # zero-time bookkeeping: free the slot's device copy         "w3 E5.r0"
    STEP = "O"        # host: per-layer optimizer step                             "h O.l7"
    COPY = "C"        # host: per-layer master -> compute-copy copy                "h C.l7"


class ProgramError(ValueError):
    """A Program breaks a rule; the message names the rule and the instruction, with the grid."""

    def __init__(self, rule: str, instr: str | None, message: str, grid: str = "") -> None:
        self.rule, self.instr = rule, instr
        where = f" at {instr}" if instr else ""
        super().__init__(f"[{rule}]{where}: {message}" + (f"\n{grid}" if grid else ""))


class Lane(str, enum.Enum):
    """Execution lanes; each (worker, lane) runs its instructions FIFO."""

    COMPUTE = "compute"
    ACT_UP = "act_up"        # high priority
    PARAM_UP = "param_up"    # low priority
    ACT_DOWN = "act_down"    # high priority
    GRAD_DOWN = "grad_down"  # low priority
    OPTIMIZER = "optimizer"  # host
    COPY = "copy"            # host


LANE_OF = {
    Op.PARAM_UP: Lane.PARAM_UP, Op.ACT_UP: Lane.ACT_UP, Op.FORWARD: Lane.COMPUTE, Op.FUSED: Lane.COMPUTE,
    Op.RECOMPUTE: Lane.COMPUTE, Op.BACKWARD: Lane.COMPUTE, Op.ACT_DOWN: Lane.ACT_DOWN,
    Op.GRAD_DOWN: Lane.GRAD_DOWN, Op.RELEASE: Lane.COMPUTE, Op.STEP: Lane.OPTIMIZER, Op.COPY: Lane.COPY,
}
HOST_OPS = frozenset({Op.STEP, Op.COPY})
MB_OPS = frozenset({Op.ACT_UP, Op.FORWARD, Op.FUSED, Op.RECOMPUTE, Op.BACKWARD, Op.ACT_DOWN})
COMPUTE_OPS = frozenset({Op.FORWARD, Op.FUSED, Op.RECOMPUTE, Op.BACKWARD})
CHUNK_OPS = frozenset({Op.PARAM_UP, Op.GRAD_DOWN})

_NAME = re.compile(r"^(?:h|w(\d+)) ([A-Z])(\d*)(?:\.m(\d+)(g?))?(?:\.r(\d+))?(?:\.c(\d+))?(?:\.l(\d+))?$")
_REF = re.compile(r"^(.*?)(?:@-(\d+))?(?:\[t>=(\d+)\])?$")


@dataclass(frozen=True, slots=True)
class Ref:
    """A completion dependency on the instruction `name`, `back` iterations earlier.

    Applies in iteration t only when t - back >= 0 and t >= since (see module Note).

    >>> str(Ref("h C.l7", back=1, since=2))
    'h C.l7@-1[t>=2]'
    """

    name: str       # e.g. "w3 B5.m2" or "h C.l7", as in this program's instrs
    back: int = 0   # 0 = this iteration, k = the instance k iterations earlier
    since: int = 0  # the dependency applies only in iterations t >= since

    def __str__(self) -> str:
        return self.name + (f"@-{self.back}" if self.back else "") + (f"[t>={self.since}]" if self.since else "")

    @classmethod
    def from_str(cls, text: str) -> "Ref":
        """Parse `str(ref)` back."""
        m = _REF.match(text.strip())
        name = m.group(1)
        _NAME.match(name) or _bad(text, "a dependency")
        return cls(name, int(m.group(2) or 0), int(m.group(3) or 0))


@dataclass(frozen=True, slots=True)
class Instr:
    """One instruction of one iteration; see the module docstring for the text form."""

    op: Op
    worker: int                 # -1 for host instructions
    stage: int = -1             # slot position in the round (index into plan.stages), -1 if n/a
    mb: int = -1                # microbatch in the iteration (round = mb // R), -1 if n/a
    round: int = -1             # for P/G/E
    chunk: int = -1             # for P/G
    layer: int = -1             # for O/C
    deps: tuple[Ref, ...] = ()  # completion dependencies
    grad: bool = False          # U only: the input gradient of a B slot (text suffix "g")

    @property
    def lane(self) -> Lane:
        return LANE_OF[self.op]

    @property
    def is_host(self) -> bool:
        return self.op in HOST_OPS

    @property
    def name(self) -> str:
        """The compact text without deps, e.g. 'w3 B5.m2'; unique within an iteration."""
        o = self.op.value
        if self.op in HOST_OPS:
            return f"h {o}.l{self.layer}"
        w = f"w{self.worker} {o}{self.stage}"
        if self.op in MB_OPS:
            return f"{w}.m{self.mb}" + ("g" if self.grad and self.op is Op.ACT_UP else "")
        if self.op is Op.RELEASE:
            return f"{w}.r{self.round}"
        return f"{w}.r{self.round}.c{self.chunk}"

    @property
    def short(self) -> str:
        """The name without the worker prefix, e.g. 'B5.m2' (grid cells)."""
        return self.name.split(" ", 1)[1]

    def __str__(self) -> str:
        return self.name + (" <- " + ",".join(str(d) for d in self.deps) if self.deps else "")

    @classmethod
    def from_str(cls, text: str) -> "Instr":
        """Parse `str(instr)` back (exact round trip).

        >>> str(Instr.from_str("h O.l3 <- h O.l4,h C.l3@-1"))
        'h O.l3 <- h O.l4,h C.l3@-1'
        """
        name, _, deps = text.strip().partition(" <- ")
        m = _NAME.match(name) or _bad(text, "an instruction")
        w, o, st, mb, g, rd, ch, ly = m.groups()
        try:
            op = Op(o)
        except ValueError:
            _bad(text, f"an instruction (unknown op {o!r})")
        i = cls(op, -1 if w is None else int(w), _int(st), _int(mb), _int(rd), _int(ch), _int(ly),
                tuple(Ref.from_str(d) for d in deps.split(",")) if deps else (), g == "g")
        if i.name != name:
            _bad(text, f"an instruction (fields do not fit op {op.name})")
        return i

    def with_worker(self, shift: int, gpus: int) -> "Instr":
        """This instruction with device worker ids (its own and its refs') moved by `shift` mod gpus."""
        deps = tuple(replace(d, name=_shift_name(d.name, shift, gpus)) for d in self.deps)
        w = self.worker if self.is_host else (self.worker + shift) % gpus
        return replace(self, worker=w, deps=deps)


@dataclass(frozen=True, slots=True)
class Chunk:
    """What one P/G chunk of a stage carries: pieces of its layers' flat parameter bytes.

    >>> Chunk(stage=0, index=1, pieces=((2, 0, 512),), bytes=512).layers
    (2,)
    """

    stage: int
    index: int
    pieces: tuple[tuple[int, int, int], ...]  # (layer, start_byte, stop_byte)
    bytes: int

    @property
    def layers(self) -> tuple[int, ...]:
        """Distinct layers touched by this chunk, ascending."""
        return tuple(sorted({p[0] for p in self.pieces}))


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
        from rpcompile.program_io import grid
        return grid(self, mark=mark, context=context)

    def __str__(self) -> str:
        return self.grid()

    def to_csv(self, path) -> None:
        """Write a lossless CSV (meta, chunks, instructions with deps)."""
        from rpcompile.program_io import to_csv
        to_csv(self, path)

    @classmethod
    def from_csv(cls, path) -> "Program":
        """Read `to_csv` output back (equal to the original)."""
        from rpcompile.program_io import from_csv
        return from_csv(path)

    def to_chrome_trace(self, path, timeline=None) -> None:
        """Write chrome://tracing JSON, one event per instruction.

        Args:
            path: output file.
            timeline: None (unit-time placeholders: each instruction lasts 1 us after its deps and
                lane predecessor), a mapping name -> (start, end) in seconds, or an object with
                `start` and `end` mappings name -> seconds.
        """
        from rpcompile.program_io import to_chrome_trace
        to_chrome_trace(self, path, timeline)


def _int(s: str | None) -> int:
    return -1 if s is None or s == "" else int(s)


def _bad(text: str, what: str):
    raise ValueError(f"cannot parse {text!r} as {what}")


def _shift_name(name: str, shift: int, gpus: int) -> str:
    """Move the worker id inside an instruction name."""
    if not name.startswith("w"):
        return name
    w, rest = name[1:].split(" ", 1)
    return f"w{(int(w) + shift) % gpus} {rest}"
