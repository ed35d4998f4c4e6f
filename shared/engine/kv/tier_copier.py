"""Runs HiCache's copy ops on worker threads: device <-> host pages <-> disk files.

The host tier is one tensor ``host  # [pages, layers, 2 (K/V), block_size, kv_heads, head_dim]``
(pinned on a CUDA machine, so copies are asynchronous DMA). A page is one device KV block of
every layer. On a GPU, device<->host copies run on side streams that the workers synchronize
before reporting an op done; on a CPU they are plain copies on the worker threads. Either way
the engine thread never waits for a whole copy: it polls ``completed()`` once per step.

Two threads: the *worker* runs ops in submission order (backups, spills, prefetches, loads
that may read disk); the *loader* runs layer-by-layer loads (`Load.fence`), which read only
host pages no other op touches and write fresh blocks, so they need no place in that order
and never queue behind a disk read. The loader copies one layer at a time (on its own stream
on a GPU) and signals each layer on the load's fence, so the forward pass of the request
being loaded runs layer ``l`` while layers ``l + 1 ...`` are still copying.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from shared.engine.kv.disk_tier import DiskTier
from shared.engine.kv.layer_fence import LayerFence
from shared.engine.kv.tier_ops import Backup, DeleteFiles, Load, OpDone, Prefetch, Spill, TierOp
from shared.model.llama import KVCache

_STOP = object()
log = logging.getLogger(__name__)


def page_bytes(kv_caches: list[KVCache]) -> int:
    """Bytes of one page: one block of K and V in every layer."""
    k = kv_caches[0][0]
    return 2 * len(kv_caches) * k[0].numel() * k.element_size()


class TierCopier:
    """Owns the host tensor and the worker. ``submit`` queues; ``completed`` collects."""

    def __init__(self, kv_caches: list[KVCache], num_host_pages: int, disk: DiskTier | None) -> None:
        k0 = kv_caches[0][0]  # [num_blocks, ...]: a block's K is k0[block] whatever the layout
        self.kv_caches = kv_caches
        self.disk = disk
        self.page_bytes = page_bytes(kv_caches)
        pin = k0.is_cuda
        self.host = torch.zeros((num_host_pages, len(kv_caches), 2, k0[0].numel()), dtype=k0.dtype,
                                pin_memory=pin)  # a page: each layer's K and V block, flat
        self._valid = bytearray(num_host_pages)  # worker-only: the page holds the data keyed to it
        self._stream = torch.cuda.Stream(device=k0.device) if k0.is_cuda else None
        self._load_stream = torch.cuda.Stream(device=k0.device) if k0.is_cuda else None
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._layer_todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0  # submitted and not yet collected (engine thread)
        self._queued = 0  # submitted and not yet run (guarded by _cv)
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="hicache-copier", daemon=True)
        self._thread.start()
        self._loader = threading.Thread(target=self._work_layers, name="hicache-loader", daemon=True)
        self._loader.start()

    # --- engine thread -------------------------------------------------------------------

    def submit(self, op: TierOp) -> None:
        self._pending += 1
        if isinstance(op, Load) and op.fence is not None:
            self._layer_todo.put(op)
            return
        with self._cv:
            self._queued += 1
        self._todo.put(op)

    def completed(self, timeout: float | None = None) -> list[OpDone]:
        """Ops finished since the last call, in submission order. With ``timeout``, wait that
        long for the first one when none has finished yet."""
        done = []
        try:
            if timeout is not None and self._pending:
                done.append(self._done.get(timeout=timeout))
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self._pending -= len(done)
        return done

    def new_fence(self) -> LayerFence:
        """The fence of a layer-by-layer load into this copier's KV pool."""
        return LayerFence(len(self.kv_caches), self.kv_caches[0][0].device)

    @property
    def pending(self) -> int:
        return self._pending

    def run_now(self, op: TierOp) -> OpDone:
        """Run ``op`` on the calling thread once every queued op has run (write-back at device
        eviction: the block is reused right after, so its copy cannot wait in the queue).
        Layer-by-layer loads need not have run: they touch neither its blocks nor its pages."""
        with self._cv:
            self._cv.wait_for(lambda: self._queued == 0)
        return self._run(op)

    def close(self) -> None:
        self._todo.put(_STOP)
        self._layer_todo.put(_STOP)
        self._thread.join(timeout=10)
        self._loader.join(timeout=10)

    # --- worker ----------------------------------------------------------------------------

    def _work(self) -> None:
        while (op := self._todo.get()) is not _STOP:
            self._done.put(self._run(op))
            with self._cv:
                self._queued -= 1
                self._cv.notify_all()

    def _work_layers(self) -> None:
        while (op := self._layer_todo.get()) is not _STOP:
            start, error = time.perf_counter(), None
            try:
                with torch.inference_mode(), _SideStream(self._load_stream):
                    self._copy_up(op.blocks, op.pages, op.fence)
            except Exception as e:  # a device error: report it, never leave a reader waiting
                log.exception("KV tier layer-by-layer load of %s failed", op.request_id)
                op.fence.release()
                error = repr(e)
            self._done.put(OpDone(op, time.perf_counter() - start, error))

    def _run(self, op: TierOp) -> OpDone:
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                if isinstance(op, Backup):
                    self._backup(op)
                elif isinstance(op, Spill):
                    self._spill(op)
                elif isinstance(op, Prefetch):
                    op.ok = [self._read_page(h, p) for h, p in zip(op.hashes, op.pages, strict=True)]
                elif isinstance(op, Load):
                    self._load(op)
                elif isinstance(op, DeleteFiles):
                    for h in op.hashes:
                        self.disk.delete_file(h)
        except Exception as e:  # a disk or device error: the op promised nothing (HiCache forgets its pages)
            log.exception("KV tier %s failed", type(op).__name__)
            if isinstance(op, Load):
                op.num_ok = 0
            elif isinstance(op, Prefetch):
                op.ok = [False] * len(op.pages)
            return OpDone(op, time.perf_counter() - start, repr(e))
        return OpDone(op, time.perf_counter() - start)

    def _backup(self, op: Backup) -> None:
        blocks = torch.tensor(op.blocks, dtype=torch.int64, device=self.kv_caches[0][0].device)
        pages = torch.tensor(op.pages, dtype=torch.int64)
        for p in op.pages:
            self._valid[p] = 0
        with self._on_side_stream():
            # NOTE: on a GPU these are pinned temporaries whose copies are still in flight; they
            # are complete only once the side stream is synchronized (on leaving this block).
            staged = [[_blocks(cache).index_select(0, blocks).to("cpu", non_blocking=True) for cache in kv_cache]
                      for kv_cache in self.kv_caches]
        for layer, pair in enumerate(staged):
            for kv, tensor in enumerate(pair):
                self.host[pages, layer, kv] = tensor
        for p in op.pages:
            self._valid[p] = 1

    def _spill(self, op: Spill) -> None:
        for page, page_hash in zip(op.pages, op.hashes, strict=True):
            if self._valid[page]:
                self.disk.write_file(page_hash, self.host[page].view(-1).view(torch.uint8).numpy().data)

    def _read_page(self, page_hash: bytes, page: int) -> bool:
        payload = self.disk.read_file(page_hash, self.page_bytes) if self.disk is not None else None
        self._valid[page] = payload is not None
        if payload is not None:
            self.host[page].view(-1).view(torch.uint8).copy_(torch.frombuffer(payload, dtype=torch.uint8))
        return payload is not None

    def _load(self, op: Load) -> None:
        n = 0
        for page, page_hash, from_disk in zip(op.pages, op.hashes, op.from_disk, strict=True):
            if not (self._read_page(page_hash, page) if from_disk else self._valid[page]):
                break
            n += 1
        op.num_ok = n
        for page, from_disk in zip(op.pages[n:], op.from_disk[n:], strict=True):
            if from_disk:  # never read: the page still holds its previous hash's bytes
                self._valid[page] = 0
        if n == 0:
            return
        with self._on_side_stream():
            self._copy_up(op.blocks[:n], op.pages[:n])

    def _copy_up(self, blocks: list[int], pages: list[int], fence: LayerFence | None = None) -> None:
        """Host ``pages`` -> device ``blocks``, one layer at a time on the current stream, each
        layer gathered into its own (pinned, on a GPU) staging tensor; ``fence`` is told as
        each layer lands."""
        dev = self.kv_caches[0][0].device
        block_ids = torch.tensor(blocks, dtype=torch.int64, device=dev)
        page_ids = torch.tensor(pages, dtype=torch.int64)
        pin = self.host.is_pinned()
        for layer, kv_cache in enumerate(self.kv_caches):
            for kv, cache in enumerate(kv_cache):
                src = self.host[:, layer, kv]  # [pages, block elements], a view
                staged = torch.empty((len(pages), *src.shape[1:]), dtype=src.dtype, pin_memory=pin)
                torch.index_select(src, 0, page_ids, out=staged)
                _blocks(cache).index_copy_(0, block_ids, staged.to(dev, non_blocking=True))
            if fence is not None:
                fence.landed(layer)

    def _on_side_stream(self):
        """A context that runs copies on the side stream and waits for them on exit (GPU)."""
        return _SideStream(self._stream)


def _blocks(cache: torch.Tensor) -> torch.Tensor:
    """A K or V pool as one flat row per block (either layout of ``kernels.kv_layout``)."""
    return cache.view(cache.shape[0], -1)


class _SideStream:
    """Run on ``stream`` after the work already on the default stream; wait for it on exit.
    A no-op on a CPU (``stream`` None)."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self._ctx = None

    def __enter__(self) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            self._ctx = torch.cuda.stream(self.stream)
            self._ctx.__enter__()

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            self._ctx.__exit__(*exc)
            self.stream.synchronize()
