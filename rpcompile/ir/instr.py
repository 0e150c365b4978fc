"""Instructions of a Program: kinds (`Op`), lanes, dependency references and parameter chunks.

Each record has a compact text form that parses back:

    >>> i = Instr.from_str("w3 B5.m2 <- w3 R5.m2")
    >>> str(i), i.lane.value
    ('w3 B5.m2 <- w3 R5.m2', 'compute')
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, replace


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
    _name: str = field(init=False, repr=False, compare=False)  # `name`, made once: the simulator, the verifier
                                                               # and codegen read it about 5 times per instr

    def __post_init__(self) -> None:
        object.__setattr__(self, "_name", self._text())

    @property
    def lane(self) -> Lane:
        return LANE_OF[self.op]

    @property
    def is_host(self) -> bool:
        return self.op in HOST_OPS

    @property
    def name(self) -> str:
        """The compact text without deps, e.g. 'w3 B5.m2'; unique within an iteration."""
        return self._name

    def _text(self) -> str:
        """`name`, formatted from the fields."""
        o = self.op._value_  # the member's value, without the `value` property (made for every instruction)
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
