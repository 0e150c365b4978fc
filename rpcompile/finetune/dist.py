"""Fine-tuning across servers: one process per server under torchrun, data parallel (`compile(dist=True)`).

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        -m rpcompile finetune --model ./Qwen3-1.7B --data chat.jsonl --out ./tuned --microbatches 32

`Ranks.from_env()` reads what torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and opens the gloo group that `compile(dist=True)` then trains
over. The flags describe the whole step: `--microbatches M` counts the
microbatches of all W ranks together and each runs M/W of them (`Ranks.share`:
rank r takes the r-th contiguous share of every step's sequences), so the same
command trains the same model at any world size. Rank 0 alone writes (the
metrics, the run record, the token cache, the checkpoints and the exported
model); on `--resume` it sends the checkpoint to the others (`fetch_checkpoint`),
so the servers need no shared file system. With `--shard-state` each rank writes its own slice of
each checkpoint into its own out, and on `--resume` the slices travel to every rank the same way (any
number of servers resumes it).

The start: each rank prints one line saying what it waits for (the other ranks, or rank 0), at which
address, and that the values come from the environment; the rendezvous (a `TCPStore` at
MASTER_ADDR:MASTER_PORT) has its own deadline (`--dist-timeout`, 60 s by default) and a rank that is
left alone ends with one line (a TimeoutError) instead of waiting for the group's timeout.
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import hashlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from rpcompile import checkpoint
from rpcompile.runtime.distributed import DistConfig, init_group, shard

__all__ = ["Ranks", "CHUNK_BYTES", "rendezvous"]

CHUNK_BYTES = 64 * 2**20  # a checkpoint crosses to the other ranks in pieces of this size


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's place in a data-parallel run (rank 0 of 1 when not launched by torchrun)."""

    rank: int = 0  # this process
    world: int = 1  # processes in all (one per server)
    group: Any = None  # the torch.distributed group (None alone)

    @classmethod
    def from_env(cls, timeout: float = 60.0) -> "Ranks":
        """The ranks torchrun describes in the environment; alone (rank 0 of 1) without WORLD_SIZE > 1.

        Args:
            timeout: seconds to wait for every rank to join (`rendezvous`).
        Raises:
            ValueError: WORLD_SIZE > 1 without RANK, MASTER_ADDR or MASTER_PORT.
            TimeoutError: the ranks did not all join within `timeout` (one line).
        """
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return cls()
        if not torch.distributed.is_initialized():
            rendezvous(world, timeout)
        group = init_group(DistConfig())
        return cls(torch.distributed.get_rank(group), world, group)

    @property
    def writes(self) -> bool:
        """Whether this process writes files (rank 0 only)."""
        return self.rank == 0

    def microbatches(self, total: int) -> int:
        """This rank's microbatches of a step of `total`; ValueError unless the world divides it."""
        if total % self.world:
            raise ValueError(f"--microbatches {total} counts the microbatches of all {self.world} processes and "
                             f"must be a multiple of {self.world} (each runs an equal share)")
        return total // self.world

    def share(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's contiguous share of a step's global batch."""
        return shard(batch, self.rank, self.world) if self.world > 1 else batch

    def on_rank0(self, check: Any) -> None:
        """Run `check()` on rank 0 and raise its ValueError/OSError on every rank (the others would wait).

        Alone, simply `check()`. Used for what only rank 0 can check: its output folder, its run record.
        """
        if self.world == 1:
            check()
            return
        why: list[Any] = [None]
        if self.writes:
            try:
                check()
            except (ValueError, OSError) as exc:
                why[0] = (type(exc).__name__, str(exc))
        torch.distributed.broadcast_object_list(why, 0, group=self.group)
        if why[0] is not None:
            kind = {"FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError,
                    "NotADirectoryError": NotADirectoryError}.get(why[0][0], ValueError)
            raise kind(why[0][1] if self.writes else f"rank 0: {why[0][1]}")

    def same_everywhere(self, value: str, what: str) -> None:
        """Raise ValueError on every rank unless every rank holds the same `value` (e.g. a data fingerprint)."""
        if self.world == 1:
            return
        found: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(found, value, group=self.group)
        bad = [r for r, v in enumerate(found) if v != found[0]]
        if bad:
            raise ValueError(f"data parallel: {what} of rank {bad[0]} differs from rank 0's (every server must "
                             f"train on the same files with the same settings)")

    def fetch_checkpoint(self, path: str) -> str:
        """A local path to rank 0's checkpoint `path` on every rank (its own file on rank 0, a temporary copy on the
        others), with the other slices of a sharded one (`--shard-state`: rank r's slice is in rank r's out)
        beside it, as `rpcompile.checkpoint.shard_path` names them: sent by a rank that holds it.

        The caller removes what was copied (`release`) once loaded. Every rank must call it.
        Raises:
            ValueError: a slice of a sharded checkpoint is on no server (name it; copy it into any out).
        """
        if self.world == 1:
            return path
        held = sorted(glob.glob(glob.escape(path) + ".shard*-of-*"))  # this rank's slices, of any world size
        found: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(found, [os.path.basename(h) for h in held], group=self.group)
        local = self._receive(path, 0, None)  # rank 0's own file there, a temporary copy elsewhere
        if not any(found):  # a checkpoint of whole state
            return local
        world = [None]
        if self.writes:  # which world wrote it: rank 0's file says (a slice left by an earlier one may be around)
            world[0] = (checkpoint.load(path)["host"].get("shard") or (0, 1))[1]
        torch.distributed.broadcast_object_list(world, 0, group=self.group)
        folder = tempfile.mkdtemp(prefix="rpcompile-resume-")
        linked = os.path.join(folder, os.path.basename(path))
        os.symlink(os.path.abspath(local), linked) if local == path else os.replace(local, linked)
        for r in range(1, world[0]):
            name = os.path.basename(checkpoint.shard_path(path, r, world[0]))
            src = next((k for k, names in enumerate(found) if name in names), None)
            if src is None:
                raise ValueError(f"--resume: the checkpoint was written by {world[0]} servers but its slice {name} is "
                                 f"in no server's out; copy it into --out on any of them")
            mine = os.path.join(os.path.dirname(path), name)
            self._receive(mine, src, os.path.join(folder, name))
        return linked

    def _receive(self, path: str, src: int, dest: str | None) -> str:
        """Rank `src`'s file `path` on every rank: `dest` (or a temporary file) on the others, a link on `src`."""
        mine = self.rank == src
        size = torch.tensor([os.path.getsize(path) if mine else 0], dtype=torch.int64)
        torch.distributed.broadcast(size, src, group=self.group)
        digest = hashlib.sha256()
        if mine:
            if dest is not None:
                os.symlink(os.path.abspath(path), dest)
            out, local = None, dest or path
        else:
            fd, local = (os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL), dest) if dest else \
                tempfile.mkstemp(prefix="rpcompile-resume-", suffix=".rp")
            out = os.fdopen(fd, "wb")
        source = open(path, "rb") if mine else None
        try:
            left = int(size)
            while left:
                n = min(left, CHUNK_BYTES)
                buf = torch.frombuffer(bytearray(source.read(n)), dtype=torch.uint8) if source else \
                    torch.empty(n, dtype=torch.uint8)
                torch.distributed.broadcast(buf, src, group=self.group)
                digest.update(buf.numpy().tobytes())
                if out is not None:
                    out.write(buf.numpy().tobytes())
                left -= n
        finally:
            if source is not None:
                source.close()
            if out is not None:
                out.close()
        self.same_everywhere(digest.hexdigest(), f"the checkpoint file {os.path.basename(path)} received")
        return local

    def release(self, local: str, path: str) -> None:
        """Remove what `fetch_checkpoint` made (rank 0 keeps its own file; links are removed, not followed)."""
        if local == path:
            return
        folder = os.path.dirname(local)
        if os.path.basename(folder).startswith("rpcompile-resume-"):
            shutil.rmtree(folder)
        else:
            os.remove(local)


def rendezvous(world: int, timeout: float) -> None:
    """Join the `world` ranks the environment names (gloo), saying so in one line; give up after `timeout` s.

    Raises:
        ValueError: RANK, MASTER_ADDR or MASTER_PORT is missing or not a number.
        TimeoutError: not every rank joined in time (or the address cannot be used), in one line.

    Example:
        >>> rendezvous(2, 60.0)   # doctest: +SKIP
        rank 0 of 2: waiting up to 60 s (--dist-timeout) for 1 more rank to join at 10.0.0.1:29500 (RANK, ...
    """
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(f"WORLD_SIZE={world} is set in the environment but {', '.join(missing)} not: launch with "
                         f"torchrun, or unset WORLD_SIZE to train alone")
    try:
        rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
    except ValueError:
        raise ValueError(f"RANK={os.environ['RANK']!r} and MASTER_PORT={os.environ['MASTER_PORT']!r} in the "
                         f"environment must be whole numbers") from None
    addr = os.environ["MASTER_ADDR"]
    what = f"{world - 1} more rank(s) to join" if rank == 0 else "rank 0"
    print(f"rank {rank} of {world}: waiting up to {timeout:g} s (--dist-timeout) for {what} at {addr}:{port} "
          f"(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from the environment)", flush=True)
    try:
        with _quiet_stderr():  # c10d logs every failed connection attempt, with a C++ stack, to stderr
            store = torch.distributed.TCPStore(addr, port, world, is_master=rank == 0, wait_for_workers=True,
                                               timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:  # DistStoreError, DistNetworkError: a RuntimeError
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TimeoutError(f"distributed start: rank {rank} of {world} gave up at {addr}:{port} after "
                           f"--dist-timeout {timeout:g} s ({why}); start every rank, raise --dist-timeout, or unset "
                           f"WORLD_SIZE (it comes from the environment) to train alone") from None
    group_timeout = datetime.timedelta(seconds=DistConfig().timeout_s)
    store.set_timeout(group_timeout)  # --dist-timeout bounds the start only, not the store's later waits
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=group_timeout)


@contextlib.contextmanager
def _quiet_stderr():
    """Send file descriptor 2 to /dev/null for the block (what C++ code writes there too)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
