"""All-to-all and all-reduce through shared memory, for CPU ranks on one host.

Gloo moves every collective through loopback TCP: ranks on one host send each step's pooled
embeddings, their gradients and DDP's buckets through the kernel's socket buffers, and those
copies and the waits run on the cores that train. Here each rank writes what it sends once into
memory the others map, and a futex wakes them.

:func:`shared_memory_group` returns a process group over all ranks whose ``alltoall_base`` (the
tables' input and pooled-embedding all-to-alls) and single-tensor ``allreduce`` (DDP's gradient
buckets) go through ``/dev/shm``; every other collective goes to a gloo group underneath.
The speed-ups layer gives it to TorchRec's sharding and to DDP (``shard_model``'s groups), and
:meth:`SharedMemoryProcessGroup.exchange`
moves the pooled embeddings in their own layout (shm_pooled.py). It is used only where every rank
can open the others' files (one host, one IPC namespace), the C kernels are built (they hold
the futex signals) and ``--shm_collectives`` is on (the default); otherwise gloo as before.

How a collective runs, numbered k = 1, 2, ... in the order the ranks issue them (the same on
every rank, as for any process group):

1. The rank writes what it sends into slot ``k % SLOTS`` of its own shared file, and where
   each destination's bytes start and end into its control file, then publishes k
   (``shm_publish`` in cpu_kernels.c: a memory fence, the counter, a futex wake). Its part
   for itself goes straight to the output.
2. ``wait()`` (for all-reduce: before it returns, unless a thread completes the ops; see
   below) waits for every rank to publish k (``shm_wait``: a futex sleep with the
   GIL released), copies what is addressed to it out of their slots (all-reduce: sums the
   ranks' tensors in rank order, so every rank gets bitwise the same result), and publishes
   "read k".
3. Slot ``k % SLOTS`` is written again, by op k + SLOTS, only after every rank has read op k;
   a rank first completes its own ops up to k, so two ranks never wait on each other.

By default no thread of its own: everything runs on the thread that issues and waits, so the
GIL never delays a rank that another rank is waiting for. With ``background=True`` (the
trainer's group for DDP) a thread completes each op as soon as every rank has published it:
an all-reduce then returns at once, and DDP waits for it only at the end of the backward
(inside the autograd engine, which lets the thread run).

The results are those of gloo: all-to-all copies bytes; all-reduce of two ranks is a + b on
both; of more ranks, the sum in rank order (gloo's ring may round the last bit differently).
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import queue
import secrets
import threading
import weakref
from datetime import timedelta
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

SHM_DIR = "/dev/shm"
SLOTS = 4
# Each rank holds SLOTS buffers as large as its largest collective: ~32 MiB for the quickstart
# model at batch 2048. With less free than this per rank (Docker's default /dev/shm is 64 MiB),
# the ranks stay on gloo.
MIN_FREE_PER_RANK = 256 << 20
BACKEND = "torchrec_cloud_shm"
_PREFIX = "torchrec-cloud-shm"
# Control file, int32 words: [0] last op published, [1] last op consumed, [2..3] the token that
# proves peers opened this file; then per slot, int64: generation, capacity, and for each
# destination rank the [start, end) of its bytes in the slot.
_PUBLISHED, _CONSUMED = 0, 1
_META_START = 16  # bytes
_REDUCE = {
    dist.ReduceOp.RedOpType.SUM: torch.add,
    dist.ReduceOp.RedOpType.PRODUCT: torch.mul,
    dist.ReduceOp.RedOpType.MIN: torch.minimum,
    dist.ReduceOp.RedOpType.MAX: torch.maximum,
}


class SharedMemoryError(RuntimeError):
    """A shared-memory collective failed (a rank stopped answering, /dev/shm is full)."""


def _wrap32(k: int) -> int:
    """Op number k as the signed 32-bit value the counters hold."""
    k &= 0xFFFFFFFF
    return k - (1 << 32) if k >= 1 << 31 else k


def _create_file(path: str, nbytes: int) -> torch.Tensor:
    """A shared uint8 tensor over a new file of nbytes, its space reserved now: a full /dev/shm
    is an error here, not a SIGBUS on first write."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise SharedMemoryError(
            f"cannot reserve {nbytes / 2**20:.1f} MiB in {SHM_DIR} for {path}: {e}. "
            f"Give the container a larger /dev/shm (docker --shm-size, or a memory emptyDir on "
            f"Kubernetes), or train with --no-shm_collectives to use gloo's TCP."
        ) from e
    os.close(fd)
    return _open_file(path, nbytes)


def _open_file(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class _Op:
    """A collective issued by this rank: done once what the other ranks sent is in its outputs."""

    __slots__ = ("k", "slot", "finish", "outputs", "done", "future")

    def __init__(self, k: int, slot: int, finish: Callable[[list[np.ndarray]], None], outputs: list[torch.Tensor]):
        self.k, self.slot, self.finish, self.outputs, self.done = k, slot, finish, outputs, False
        self.future: Optional[Future] = None  # with a completer thread


class _Work(dist._Work):
    """What ``async_op=True`` returns: ``wait()`` completes the op (and any issued before it)."""

    def __init__(self, group: "SharedMemoryProcessGroup", op: _Op):
        super().__init__()
        self._group = group
        self._op = op

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if self._op.future is not None:
            self._op.future.wait()  # raises what the completer thread set
        else:
            self._group._complete_through(self._op.k)
        return True

    def is_completed(self) -> bool:
        return self._op.done

    def is_success(self) -> bool:
        return self._op.done

    def get_future(self) -> Future:
        if self._op.future is not None:
            return self._op.future
        self.wait()
        future: Future = Future()
        future.set_result(self._op.outputs)
        return future

    def result(self) -> list[torch.Tensor]:
        return self._op.outputs


class _Mapped:
    """A shared file mapped here: the tensor keeps the mapping alive, the numpy view is cheap
    to slice and copy (a few hundred ns, against microseconds for a torch op)."""

    __slots__ = ("tensor", "bytes", "ptr")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.bytes = tensor.numpy()
        self.ptr = tensor.data_ptr()


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().view(-1).view(torch.uint8).numpy()


def _nbytes(piece) -> int:
    return piece.size if isinstance(piece, np.ndarray) else piece.numel() * piece.element_size()


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) & ~63


def copy(dst: torch.Tensor, src: torch.Tensor, divisor: int = 1) -> None:
    """dst.copy_(src) for CPU tensors of the same shape and dtype, through numpy where it can:
    numpy copies a block of rows or columns row by row with memcpy, several times faster than
    torch's strided copy from a block of columns. With a divisor, ``torch.div(src, divisor, out=dst)`` in the same pass: IEEE division, so bitwise
    what ``div_`` gives afterwards."""
    try:
        if divisor == 1:
            np.copyto(dst.detach().numpy(), src.detach().numpy())
        else:
            np.divide(src.detach().numpy(), divisor, out=dst.detach().numpy())
    except TypeError:  # a dtype numpy lacks (bfloat16)
        dst.copy_(src)
        if divisor != 1:
            dst.div_(divisor)


def as_tensor(chunk: np.ndarray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """What a rank sent in :meth:`SharedMemoryProcessGroup.exchange`, as a tensor (no copy)."""
    return torch.from_numpy(chunk).view(dtype).view(shape)


class SharedMemoryProcessGroup(dist.ProcessGroup):
    """See the module's docstring. Made by :func:`shared_memory_group`."""

    def __init__(self, gloo: dist.ProcessGroup, run: str, timeout: timedelta, lib: ctypes.CDLL,
                 background: bool = False):  # fmt: skip
        super().__init__(gloo.rank(), gloo.size())
        self._gloo = gloo
        self._me, self._n = gloo.rank(), gloo.size()
        self._run = run
        self._timeout_ms = int(timeout.total_seconds() * 1000)
        self._lib = lib
        self._k = 0  # last op issued
        self._meta_words = 2 + 2 * self._n
        self._ctrl_bytes = _META_START + SLOTS * self._meta_words * 8
        self._files: list[str] = []
        self._ctrl = self._create(self._path(self._me, "ctrl"), self._ctrl_bytes)  # zeroed: a new file
        self._token = secrets.randbits(62)
        self._ctrl.bytes[8:16].view(np.int64)[0] = self._token
        self._slots: list[Optional[_Mapped]] = [None] * SLOTS
        self._gen = [0] * SLOTS
        # A slot's file keeps its name until every rank has read one op from it (and so has
        # it mapped); then only the mappings hold the memory, and a killed run leaves nothing.
        self._named = [False] * SLOTS
        self._peer_ctrl: dict[int, _Mapped] = {self._me: self._ctrl}
        self._peer_slots: dict[tuple[int, int], tuple[int, _Mapped]] = {}
        self._pending: collections.deque[_Op] = collections.deque()
        self._failure: Optional[BaseException] = None
        self._completer: Optional[queue.SimpleQueue] = None
        if background:
            self._completer = queue.SimpleQueue()
            threading.Thread(target=self._complete_in_background, name="torchrec-cloud-shm", daemon=True).start()
        atexit.register(_close_ref, weakref.ref(self))

    # -- files -------------------------------------------------------------------------

    def _path(self, rank: int, what: str) -> str:
        return f"{SHM_DIR}/{_PREFIX}-{self._run}-r{rank}-{what}"

    def _create(self, path: str, nbytes: int) -> _Mapped:
        mapped = _Mapped(_create_file(path, nbytes))
        self._files.append(path)
        return mapped

    def _remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if path in self._files:
            self._files.remove(path)

    def _meta(self, ctrl: _Mapped) -> np.ndarray:
        """[slot, word]: generation, capacity, then [start, end) per destination rank."""
        return ctrl.bytes[_META_START:].view(np.int64).reshape(SLOTS, self._meta_words)

    def _control_of(self, rank: int) -> _Mapped:
        ctrl = self._peer_ctrl.get(rank)
        if ctrl is None:
            ctrl = _Mapped(_open_file(self._path(rank, "ctrl"), self._ctrl_bytes))
            self._peer_ctrl[rank] = ctrl
        return ctrl

    def peer_tokens(self) -> list[int]:
        """The token each rank wrote into its control file, as this rank reads it."""
        return [int(self._control_of(r).bytes[8:16].view(np.int64)[0]) for r in range(self._n)]

    def _slot_for_write(self, slot: int, nbytes: int) -> _Mapped:
        buf = self._slots[slot]
        if buf is None or buf.bytes.size < nbytes:
            if buf is not None:  # every rank has read the op that used it (see _issue)
                self._remove(self._path(self._me, f"s{slot}g{self._gen[slot]}"))
            self._gen[slot] += 1
            cap = max(1 << 16, 1 << max(nbytes - 1, 1).bit_length())
            buf = self._create(self._path(self._me, f"s{slot}g{self._gen[slot]}"), cap)
            self._slots[slot] = buf
            self._named[slot] = True
        return buf

    def _slot_of(self, rank: int, slot: int, gen: int, cap: int) -> np.ndarray:
        if rank == self._me:
            return self._slots[slot].bytes
        held = self._peer_slots.get((rank, slot))
        if held is None or held[0] != gen:
            held = (gen, _Mapped(_open_file(self._path(rank, f"s{slot}g{gen}"), cap)))
            self._peer_slots[(rank, slot)] = held
        return held[1].bytes

    # -- signals -----------------------------------------------------------------------

    def _wait_all(self, word: int, k: int, what: str) -> None:
        for r in range(self._n):
            rc = self._lib.shm_wait(self._control_of(r).ptr + 4 * word, _wrap32(k), self._timeout_ms)
            if rc != 0:
                raise SharedMemoryError(
                    f"rank {self._me}: rank {r} did not {what} shared-memory collective {k} within "
                    f"{self._timeout_ms / 1000:.0f} s (a rank stopped, or the ranks issued different collectives)"
                )

    def _publish(self, word: int, k: int) -> None:
        self._lib.shm_publish(self._ctrl.ptr + 4 * word, _wrap32(k))

    # -- issuing and completing ----------------------------------------------------------

    def exchange(self, pieces: list[Optional[torch.Tensor]], finish: Callable[[list[np.ndarray]], None],
                 divisor: int = 1) -> _Work:  # fmt: skip
        """An all-to-all of the caller's own layout: ``pieces[r]`` (a tensor of any strides; None
        for this rank's own entry) goes to rank r, divided by ``divisor`` on the way, and
        ``finish`` gets what each rank sent here, as bytes that ``as_tensor`` views, when the
        returned work is waited on (this rank's own entry empty). Used by shm_pooled.py to move
        pooled embeddings and their gradients with fewer copies."""
        empty = np.empty(0, np.uint8)
        return self._issue([empty if p is None else p for p in pieces], finish, [], divisor=divisor)

    def _issue(self, pieces: list, finish: Callable[[list[np.ndarray]], None],
               outputs: list[torch.Tensor], now: bool = False, divisor: int = 1) -> _Work:  # fmt: skip
        """Write pieces (bytes, or tensors divided by divisor) to this op's slot and publish it:
        one piece per destination rank, or a single piece that every rank reads. Each piece
        starts on a 64-byte boundary, so a receiver can view it as a tensor of its dtype. With
        now, complete it before returning."""
        if self._failure is not None:
            raise SharedMemoryError(f"an earlier shared-memory collective failed: {self._failure}")
        self._k += 1
        k, slot = self._k, self._k % SLOTS
        if k > SLOTS:
            # The slot's previous op (k - SLOTS) must have been read by every rank. Read ours
            # first: a rank never waits on another while holding back what it owes.
            if self._completer is None:
                self._complete_through(k - SLOTS)
            self._wait_all(_CONSUMED, k - SLOTS, "read")
            if self._named[slot]:
                self._remove(self._path(self._me, f"s{slot}g{self._gen[slot]}"))
                self._named[slot] = False
        sizes = [_nbytes(p) for p in pieces]
        buf = self._slot_for_write(slot, sum(_aligned(n) for n in sizes)).bytes
        meta = self._meta(self._ctrl)[slot]
        o = 0
        for i, (p, n) in enumerate(zip(pieces, sizes)):
            if n:
                if isinstance(p, np.ndarray):
                    buf[o:o + n] = p
                else:  # a tensor of any strides, written in place in the slot's layout
                    copy(as_tensor(buf[o:o + n], p.dtype, p.shape), p, divisor)
            meta[2 + 2 * i], meta[3 + 2 * i] = o, o + n
            o += _aligned(n)
        if len(pieces) == 1:
            meta[4:] = np.tile(meta[2:4], self._n - 1)
        meta[0], meta[1] = self._gen[slot], buf.size
        self._publish(_PUBLISHED, k)
        op = _Op(k, slot, finish, outputs)
        if self._completer is not None:
            op.future = Future()
            self._completer.put(op)
        else:
            self._pending.append(op)
            if now:
                self._complete_through(k)
        return _Work(self, op)

    def _complete_in_background(self) -> None:
        while True:
            op = self._completer.get()
            if op is None:
                return
            self._pending.append(op)
            try:
                self._complete_through(op.k)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                op.future.set_exception(e)
            else:
                op.future.set_result(op.outputs)

    def _complete_through(self, k: int) -> None:
        """Complete every pending op up to k, in order: wait for the other ranks to publish it,
        copy (or reduce) what they sent into its outputs, tell them it has been read."""
        me = self._me
        while self._pending and self._pending[0].k <= k:
            op = self._pending[0]
            try:
                if self._failure is not None:
                    raise SharedMemoryError(f"an earlier shared-memory collective failed: {self._failure}")
                self._wait_all(_PUBLISHED, op.k, "issue")
                chunks = []
                for r in range(self._n):
                    meta = self._meta(self._control_of(r))[op.slot]
                    gen, cap, lo, hi = int(meta[0]), int(meta[1]), int(meta[2 + 2 * me]), int(meta[3 + 2 * me])
                    chunks.append(self._slot_of(r, op.slot, gen, cap)[lo:hi])
                op.finish(chunks)
            except BaseException as e:
                self._failure = self._failure or e
                raise
            op.done = True
            self._pending.popleft()
            self._publish(_CONSUMED, op.k)

    def unlink_control(self) -> None:
        self._remove(self._path(self._me, "ctrl"))

    def close(self) -> None:
        """Delete this rank's files that still have names (also at exit)."""
        for path in list(self._files):
            self._remove(path)

    # -- the collectives moved to shared memory ----------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend_name(self) -> str:
        # What torch's Python code asks to choose a device where a rank holds no shard of a
        # ShardedTensor (``== "gloo"``: the CPU; otherwise it asks CUDA). The tensors are on
        # the CPU and gloo is underneath. C++ still sees BACKEND (getBackendName).
        return "gloo"

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        n = self._n
        if input.device.type != "cpu" or not input.is_contiguous() or not output.is_contiguous():
            return self._gloo.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        in_rows, out_rows = (input.shape[0] if input.dim() else 1), (output.shape[0] if output.dim() else 1)
        in_splits = list(input_split_sizes) or [in_rows // n] * n
        out_splits = list(output_split_sizes) or [out_rows // n] * n
        if sum(in_splits) != in_rows or sum(out_splits) != out_rows or len(in_splits) != n or len(out_splits) != n:
            raise ValueError(
                f"all-to-all splits {in_splits} -> {out_splits} do not match tensors of {in_rows} and {out_rows} rows"
            )
        in_bytes, out_bytes = _as_bytes(input), _as_bytes(output)
        in_row = in_bytes.size // in_rows if in_rows else 0
        out_row = out_bytes.size // out_rows if out_rows else 0
        pieces, o = [], 0
        for r, s in enumerate(in_splits):
            pieces.append(in_bytes[o * in_row:(o + s) * in_row] if r != self._me else in_bytes[:0])
            o += s
        if in_splits[self._me] != out_splits[self._me]:
            raise ValueError(f"all-to-all: rank {self._me} sends itself {in_splits[self._me]} rows but expects {out_splits[self._me]}")
        start = sum(out_splits[:self._me]) * out_row
        mine = sum(in_splits[:self._me]) * in_row
        nbytes = in_splits[self._me] * in_row
        out_bytes[start:start + nbytes] = in_bytes[mine:mine + nbytes]

        def finish(chunks: list[np.ndarray]) -> None:
            o = 0
            for r, chunk in enumerate(chunks):
                nbytes = out_splits[r] * out_row
                if r != self._me:  # our own part was copied when the op was issued
                    if chunk.size != nbytes:
                        raise SharedMemoryError(
                            f"rank {self._me}: all-to-all expected {nbytes} bytes from rank {r}, it sent {chunk.size}"
                        )
                    out_bytes[o:o + nbytes] = chunk
                o += nbytes

        return self._issue(pieces, finish, [output])

    def allreduce(self, tensors, opts):
        reduce = _REDUCE.get(getattr(opts.reduceOp, "op", None))
        t = tensors[0] if len(tensors) == 1 else None
        if (reduce is None or t is None or t.device.type != "cpu" or t.layout != torch.strided
                or not t.is_contiguous() or t.is_complex() or t.dtype == torch.bool):  # fmt: skip
            return self._gloo.allreduce(tensors, opts)

        flat = t.detach().view(-1)

        def finish(chunks: list[np.ndarray]) -> None:
            # In rank order, so every rank gets bitwise the same result.
            parts = [as_tensor(c, t.dtype, flat.shape) for c in chunks]
            reduce(parts[0], parts[1], out=flat)
            for p in parts[2:]:
                reduce(flat, p, out=flat)

        # Completed before returning: DDP waits on the future inside the autograd engine, where
        # nothing here would run to complete it.
        return self._issue([_as_bytes(t)], finish, [t], now=self._completer is None)

    # -- everything else: gloo ---------------------------------------------------------

    def broadcast(self, tensors, opts):
        return self._gloo.broadcast(tensors, opts)

    def allreduce_coalesced(self, tensors, opts):
        return self._gloo.allreduce_coalesced(tensors, opts)

    def reduce(self, tensors, opts):
        return self._gloo.reduce(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts):
        return self._gloo.allgather(output_tensors, input_tensors, opts)

    def _allgather_base(self, output, input, opts):
        return self._gloo._allgather_base(output, input, opts)

    def allgather_coalesced(self, output_lists, input_list, opts):
        return self._gloo.allgather_coalesced(output_lists, input_list, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        return self._gloo.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def gather(self, output_tensors, input_tensors, opts):
        return self._gloo.gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts):
        return self._gloo.scatter(output_tensors, input_tensors, opts)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        return self._gloo.reduce_scatter(output_tensors, input_tensors, opts)

    def _reduce_scatter_base(self, output, input, opts):
        return self._gloo._reduce_scatter_base(output, input, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return self._gloo.reduce_scatter_tensor_coalesced(outputs, inputs, opts)

    def alltoall(self, output_tensors, input_tensors, opts):
        return self._gloo.alltoall(output_tensors, input_tensors, opts)

    def send(self, tensors, dst, tag):
        return self._gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._gloo.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._gloo.recv_anysource(tensors, tag)

    def barrier(self, opts):
        return self._gloo.barrier(opts)


def _close_ref(ref: "weakref.ref[SharedMemoryProcessGroup]") -> None:
    group = ref()
    if group is not None:
        group.close()


_pending_backend: list[SharedMemoryProcessGroup] = []
why_not: Optional[str] = None  # why the last shared_memory_group() returned None
_made: list[tuple[weakref.ref, weakref.ref]] = []  # (group, its backend)


def _create_backend(store, rank, size, timeout):  # called by dist.new_group
    return _pending_backend.pop()


def unavailable_reason(world: dist.ProcessGroup) -> Optional[str]:
    """Why this rank cannot use shared memory, or None. Local checks only."""
    if dist.get_backend(world) != "gloo":
        return f"backend {dist.get_backend(world)}"
    return host_reason(world.size())


def host_reason(ranks: int) -> Optional[str]:
    """Why ranks on this host cannot use shared memory, or None: /dev/shm's room for that many
    ranks, and the C kernels (they hold the futex signals)."""
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return f"{SHM_DIR} is not a writable directory"
    stat = os.statvfs(SHM_DIR)
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE_PER_RANK * ranks:
        return (f"{SHM_DIR} has {free / 2**20:.0f} MiB free, less than {MIN_FREE_PER_RANK >> 20} MiB per rank "
                "(docker run --shm-size, or a memory emptyDir on Kubernetes)")
    from torchrec_cloud.speedups import native

    if native.library() is None:
        return "the C kernels are not available (not built, or --no-cpu_kernels)"
    return None


def _on_every_rank(flag: bool, group: dist.ProcessGroup) -> bool:
    ok = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok)


def shared_memory_group(timeout: timedelta = timedelta(minutes=30), background: bool = False) -> Optional[dist.ProcessGroup]:
    """A process group over all ranks that uses shared memory, or None where it cannot
    (ranks on several hosts or IPC namespaces, no /dev/shm, no C kernels).

    Collective: every rank calls it, and every rank gets a group or every rank gets None.
    """
    global why_not
    world = dist.GroupMember.WORLD
    if world is None or world.size() < 2:
        why_not = "one rank"
        return None
    reason = unavailable_reason(world)
    if not _on_every_rank(reason is None, world):
        why_not = reason or "another rank cannot use it"
        return None
    from torchrec_cloud.speedups import native

    gloo = dist.new_group(backend="gloo", timeout=timeout)
    run = [f"p{os.getpid()}-{secrets.token_hex(6)}"] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(run, src=0, group=gloo)
    group = SharedMemoryProcessGroup(gloo, run[0], timeout, native.library(), background)
    tokens = [None] * world.size()
    dist.all_gather_object(tokens, group._token, group=gloo)
    try:
        same_files = group.peer_tokens() == tokens
    except (OSError, RuntimeError):  # a peer's file is not visible here: another host or namespace
        same_files = False
    if not _on_every_rank(same_files, gloo):
        group.close()
        why_not = "the ranks cannot open each other's files (several hosts, or containers with their own /dev/shm)"
        return None
    group.unlink_control()  # every rank has it open now
    why_not = None
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create_backend, devices=["cpu"])
    _pending_backend.append(group)
    pg = dist.new_group(backend=BACKEND, timeout=timeout)
    _made.append((weakref.ref(pg), weakref.ref(group)))
    return pg


def backend_of(pg: Optional[dist.ProcessGroup]) -> Optional[SharedMemoryProcessGroup]:
    """The shared-memory backend behind a group made by :func:`shared_memory_group`, or None."""
    for p, g in _made:
        if pg is not None and p() is pg:
            return g()
    return None
