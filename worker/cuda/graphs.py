"""Decode steps replayed from CUDA graphs captured at start-up; every other step runs eagerly.

A decode step of a small model is a few hundred tiny kernels: launched one by one from Python it
takes milliseconds however fast the GPU is, replayed from a graph it takes what the kernels take.
A graph replays fixed shapes and fixed addresses, so:

- Batch sizes come in buckets (1, 2, 4, 8, ..., max): a step of n sequences replays the smallest
  bucket >= n, its extra rows padded with slot -1 and context length 0, which the paged decode
  kernels (worker/cuda/paged_decode.py) skip: they write no K/V and read no page.
- The inputs live in one static device buffer, [input ids | positions | slots | context lengths |
  page tables], sized for the largest bucket and `max_graph_context` tokens. Each step fills a
  pinned host copy of it and sends the prefix it uses in one asynchronous copy; the graph reads it
  on the same stream, so the only host sync of a step stays the sampler reading the sampled ids.
- Steps the graphs do not cover (prefill chunks, mixed steps, a context wider than the captured
  page table) run eagerly; a decode-only one still uses the paged decode kernel.

`GraphedStep` has the model's own call signature, model(batch, kv) -> logits [S, vocab], so the
CUDA step backend (worker/runtime/cuda.py) swaps it in for `loaded.model` (docs/gpu.md). The CUDA calls sit behind `CudaGraphs`; the
CPU stand-in `EagerGraphs` runs the same buffers, padding and bucket choice with the graph replaced
by a call of the same function, so tests without a GPU exercise everything but the capture itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from worker.batch import PagedKV, StepBatch
from worker.cuda.paged_decode import PagedDecode, PagedDecodeBatch, choose_splits

log = logging.getLogger(__name__)

DEFAULT_MAX_GRAPH_CONTEXT = 4096  # longer contexts decode eagerly (attention then outweighs the launches)
PADDING_SLOT = -1


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to max_batch, and max_batch itself when it is not a power of two."""
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return buckets + [max_batch]


@dataclass
class Captured:
    replay: Callable[[], None]
    output: torch.Tensor  # the logits [bucket, vocab] each replay overwrites


class CudaGraphs:
    """The CUDA side: pinned host memory, an event guarding its reuse, capture into one shared pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.side_stream = torch.cuda.Stream(device)
        self.copied = torch.cuda.Event()

    def host_buffer(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int64, pin_memory=True)

    def copy_started(self) -> None:
        self.copied.record()

    def wait_copied(self) -> None:
        """The last host-to-device copy has read the pinned buffer (it has, by the time a step's ids were read)."""
        self.copied.synchronize()

    def capture(self, forward: Callable[[], torch.Tensor]) -> Captured:
        # Warm up off the capture: Triton compiles its kernels, cuBLAS picks its algorithms.
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        return Captured(replay=graph.replay, output=output)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class EagerGraphs:
    """The CPU stand-in: a "replay" calls the captured function again over the same static buffers."""

    def host_buffer(self, size: int) -> torch.Tensor:
        return torch.zeros(size, dtype=torch.int64)

    def copy_started(self) -> None:
        pass

    def wait_copied(self) -> None:
        pass

    def capture(self, forward: Callable[[], torch.Tensor]) -> Captured:
        output = forward()

        def replay() -> None:
            with torch.inference_mode():  # as the capture ran: the output is an inference tensor
                output.copy_(forward())

        return Captured(replay=replay, output=output)

    def synchronize(self) -> None:
        pass


class StaticInputs:
    """One flat int64 buffer on the device (and its host twin): the graphs' inputs, as views."""

    def __init__(
        self, max_batch: int, width: int, device: torch.device, host_buffer: Callable[[int], torch.Tensor]
    ) -> None:
        self.max_batch, self.width = max_batch, width
        size = 4 * max_batch + max_batch * width
        self.device_flat = torch.zeros(size, dtype=torch.int64, device=device)
        self.host_flat = host_buffer(size)
        self.device_views = self._views(self.device_flat)
        self.host_views = self._views(self.host_flat)
        self.rows = torch.arange(max_batch, device=device)  # logits_indices: every row samples

    def _views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        b = self.max_batch
        return {
            "input_ids": flat[0:b],
            "positions": flat[b : 2 * b],
            "slots": flat[2 * b : 3 * b],
            "context_lens": flat[3 * b : 4 * b],
            "page_tables": flat[4 * b :].view(b, self.width),
        }

    def fill_host(self, batch: StepBatch, bucket: int) -> int:
        """Write the step into the host buffer, padding rows n..bucket; returns how many elements to send."""
        host, n = self.host_views, len(batch.query_lens)
        host["input_ids"][:n] = batch.input_ids
        host["positions"][:n] = batch.positions
        host["slots"][:n] = batch.slots
        host["context_lens"][:n] = torch.as_tensor(batch.context_lens)
        pages = batch.page_tables.shape[1]
        host["page_tables"][:n, :pages] = batch.page_tables
        self._pad(host, n, bucket)
        return 4 * self.max_batch + n * self.width  # padding rows read no page: their table rows stay behind

    def fill_device(self, batch: StepBatch, bucket: int) -> None:
        """The same from a batch already on the device: copies on the stream, no host round trip."""
        dev, n = self.device_views, len(batch.query_lens)
        dev["input_ids"][:n].copy_(batch.input_ids, non_blocking=True)
        dev["positions"][:n].copy_(batch.positions, non_blocking=True)
        dev["slots"][:n].copy_(batch.slots, non_blocking=True)
        dev["context_lens"][:n].copy_(torch.as_tensor(batch.context_lens), non_blocking=True)
        pages = batch.page_tables.shape[1]
        dev["page_tables"][:n, :pages].copy_(batch.page_tables, non_blocking=True)
        self._pad(dev, n, bucket)

    @staticmethod
    def _pad(views: dict[str, torch.Tensor], n: int, bucket: int) -> None:
        for name, value in (("input_ids", 0), ("positions", 0), ("slots", PADDING_SLOT), ("context_lens", 0)):
            views[name][n:bucket].fill_(value)

    def send(self, elements: int) -> None:
        self.device_flat[:elements].copy_(self.host_flat[:elements], non_blocking=True)

    def batch(self, bucket: int, page_size: int, num_splits: int) -> PagedDecodeBatch:
        """The step the graph of `bucket` is captured on: views of the static buffer."""
        dev = self.device_views
        page_tables, context_lens = dev["page_tables"][:bucket], dev["context_lens"][:bucket]
        return PagedDecodeBatch(
            input_ids=dev["input_ids"][:bucket],
            positions=dev["positions"][:bucket],
            slots=dev["slots"][:bucket],
            query_lens=[1] * bucket,
            context_lens=[0] * bucket,  # the lengths the graph reads are on the device
            page_tables=page_tables,
            logits_indices=self.rows[:bucket],
            decode=PagedDecode(page_tables, context_lens, page_size, num_splits=num_splits),
        )


class GraphedStep:
    """model(batch, kv) -> logits, with decode steps of up to `max_batch` sequences replayed from CUDA graphs."""

    def __init__(
        self,
        model: Callable[[StepBatch, PagedKV], torch.Tensor],
        kv: PagedKV,
        *,
        max_batch: int,
        num_kv_heads: int,
        max_graph_context: int = DEFAULT_MAX_GRAPH_CONTEXT,
        backend: CudaGraphs | EagerGraphs | None = None,
    ) -> None:
        self.model, self.kv = model, kv
        self.device = kv.k.device
        self.page_size = kv.page_size
        self.num_kv_heads = num_kv_heads
        self.backend = backend or (CudaGraphs(self.device) if self.device.type == "cuda" else EagerGraphs())
        self.buckets = batch_buckets(max_batch)
        self.max_graph_context = max_graph_context
        width = -(-max_graph_context // self.page_size)
        self.inputs = StaticInputs(self.buckets[-1], width, self.device, self.backend.host_buffer)
        self.graphs: dict[int, Captured] = {}
        self._captured_on: dict[int, PagedDecodeBatch] = {}  # a graph reads these addresses: they must outlive it
        self.replays = 0  # steps served by a graph (the benchmark reports it)
        self.eager_steps = 0

    @property
    def input_device(self) -> torch.device:
        """Where the engine should build its batches: on the host, so a replay sends them in one copy."""
        return torch.device("cpu")

    def capture(self) -> GraphedStep:
        """Capture every bucket, largest first (smaller graphs then reuse the pool's memory)."""
        host = self.inputs.host_views
        self.inputs._pad(host, 0, self.buckets[-1])  # capture on padding rows: nothing is read or written
        self.inputs.send(self.inputs.host_flat.numel())
        self.backend.synchronize()
        with torch.inference_mode():
            for bucket in reversed(self.buckets):
                batch = self.inputs.batch(bucket, self.page_size, self._splits(bucket, self.max_graph_context))
                self._captured_on[bucket] = batch
                self.graphs[bucket] = self.backend.capture(lambda batch=batch: self.model(batch, self.kv))
        self.backend.synchronize()
        log.info(
            "captured decode graphs for batch sizes %s (contexts up to %d tokens)", self.buckets, self.max_graph_context
        )
        return self

    def __call__(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        if kv.k is not self.kv.k:
            raise ValueError("the graphs were captured on another KV pool")
        bucket = self.bucket_for(batch)
        if bucket is None:
            self.eager_steps += 1
            return self._eager(batch)
        n = len(batch.query_lens)
        if batch.input_ids.device.type == "cpu":  # the engine built it on the host: one pinned copy
            self.backend.wait_copied()
            self.inputs.send(self.inputs.fill_host(batch, bucket))
            self.backend.copy_started()
        else:
            self.inputs.fill_device(batch, bucket)
        captured = self.graphs[bucket]
        captured.replay()
        self.replays += 1
        if batch.logits_indices.numel() < n:  # a one-token prompt chunk beside decodes: it does not sample
            return captured.output[batch.logits_indices.to(self.device)]
        return captured.output[:n]

    def bucket_for(self, batch: StepBatch) -> int | None:
        """The graph that serves this step, or None: not decode-only, too many sequences, or too long a context."""
        n = len(batch.query_lens)
        if not self.graphs or not batch.is_decode_only or n > self.buckets[-1]:
            return None
        if batch.page_tables.shape[1] > self.inputs.width:
            return None
        return next(bucket for bucket in self.buckets if bucket >= n)

    def _splits(self, sequences: int, context: int) -> int:
        return choose_splits(sequences, self.num_kv_heads, context, self.device)

    def _eager(self, batch: StepBatch) -> torch.Tensor:
        batch = to_device(batch, self.device)
        if batch.is_decode_only:  # the paged kernel still beats gathering, without a graph
            context_lens = torch.as_tensor(batch.context_lens).to(self.device, non_blocking=True)
            splits = self._splits(len(batch.query_lens), max(batch.context_lens))
            plan = PagedDecode(batch.page_tables, context_lens, self.page_size, num_splits=splits)
            batch = PagedDecodeBatch(**{f.name: getattr(batch, f.name) for f in fields(StepBatch)}, decode=plan)
        return self.model(batch, self.kv)


def graphed(
    model: Callable[[StepBatch, PagedKV], torch.Tensor], kv: PagedKV, *, max_batch: int, num_kv_heads: int, **options
) -> Callable[[StepBatch, PagedKV], torch.Tensor]:
    """The engine's forward with decode graphs, or the model itself where a capture fails (logged).

    A model that reads a value back to the host inside its forward (the mixture-of-experts MLP
    counts tokens per expert) cannot be captured: it keeps running eagerly.
    """
    try:
        return GraphedStep(model, kv, max_batch=max_batch, num_kv_heads=num_kv_heads, **options).capture()
    except Exception:  # noqa: BLE001 - any capture failure leaves the eager path, which works
        log.warning("CUDA graph capture failed: decode steps run eagerly", exc_info=True)
        return model


def to_device(batch: StepBatch, device: torch.device) -> StepBatch:
    """The batch's tensors on `device`, sent from pinned memory without waiting when it is a GPU."""
    if batch.input_ids.device == device:
        return batch

    def send(tensor: torch.Tensor) -> torch.Tensor:
        if device.type == "cuda" and tensor.device.type == "cpu":
            return tensor.pin_memory().to(device, non_blocking=True)
        return tensor.to(device)

    return StepBatch(
        input_ids=send(batch.input_ids),
        positions=send(batch.positions),
        slots=send(batch.slots),
        query_lens=batch.query_lens,
        context_lens=batch.context_lens,
        page_tables=send(batch.page_tables),
        logits_indices=send(batch.logits_indices),
        cascade=batch.cascade and device.type == "cpu",  # the cascade op is the CPU's
    )
