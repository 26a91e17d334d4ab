"""Engine speed on one model shape, beside transformers' generate on the same random weights and device.

Used by bench/gpu/check.py (one phase per shape). Per number of streams, through the real `Engine`
fed `GenRequest`s: decode tokens/s over the steps where every stream decodes, and the whole run's
tokens/s (prefill included: what the service comparison uses). Prefill tokens/s of one long prompt
and of a batch of short ones. Where one decode step's time goes: the graph replay alone on the GPU,
the same forward launched eagerly (paged kernel, and the CPU path's gather + SDPA), the sampler's
read of the ids, and the rest (Python: scheduling, batch building, detokenizing) from the engine's
own step time. transformers: `generate` (greedy, its default dynamic cache, SDPA) on the same
prompts, decode rate from two runs of different lengths, and one forward over the long prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.engine.random_models import hf_config, hf_model, lmq_model, random_weights
from protocol import SamplingParams
from worker import compute_thread
from worker.batch import PagedKV, StepBatch
from worker.cuda.graphs import GraphedStep
from worker.cuda.paged_decode import PagedDecode, PagedDecodeBatch, choose_splits
from worker.engine import Engine, GenRequest, SeqOutput
from worker.kv_cache import page_bytes
from worker.model.loader import LoadedModel
from worker.model.paged_attention import paged_attention, plan_attention

PAGE_SIZE = 16


@dataclass
class Sizes:
    streams: list[int]
    prompt_tokens: int  # per stream, for the decode levels
    new_tokens: int
    long_prompt: int  # the single-prompt prefill
    batch_prompts: int  # the batched prefill: this many prompts of prompt_tokens
    kv_pages: int
    step_tokens: int
    max_graph_context: int


GPU_SIZES = Sizes(streams=[1, 16, 64, 256], prompt_tokens=64, new_tokens=64, long_prompt=2048, batch_prompts=32,
                  kv_pages=8192, step_tokens=4096, max_graph_context=4096)  # fmt: skip
DRY_SIZES = Sizes(streams=[1, 4], prompt_tokens=12, new_tokens=6, long_prompt=64, batch_prompts=4, kv_pages=256,
                  step_tokens=128, max_graph_context=128)  # fmt: skip


def wrap_engine(engine: Engine, max_graph_context: int) -> GraphedStep:
    """Decode steps through CUDA graphs (the CPU stand-in on a CPU), unless the engine already does it."""
    if isinstance(engine.backend.model, GraphedStep):
        return engine.backend.model
    runner = GraphedStep(engine.backend.model, engine.kv.kv, max_batch=engine.scheduler.max_seqs,
                         num_kv_heads=engine.model.config.num_kv_heads, max_graph_context=max_graph_context)  # fmt: skip
    compute_thread.run(runner.capture)
    engine.backend.model = runner
    return runner


def random_prompts(vocab: int, count: int, length: int, salt: int) -> list[list[int]]:
    rng = random.Random(salt)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EngineBench:
    """One engine (graphs captured once) serving every level; outputs timed as they arrive."""

    def __init__(self, model: LoadedModel, sizes: Sizes) -> None:
        self.model, self.sizes = model, sizes
        per_page = page_bytes(
            model.config.num_layers, model.config.num_kv_heads, model.config.head_dim, PAGE_SIZE, model.dtype
        )
        started = time.perf_counter()
        self.engine = Engine(model, kv_memory_bytes=sizes.kv_pages * per_page, page_size=PAGE_SIZE,
                             max_seqs=max(sizes.streams + [sizes.batch_prompts]), step_tokens=sizes.step_tokens,
                             on_step=self._on_step)  # fmt: skip
        self.runner = wrap_engine(self.engine, sizes.max_graph_context)
        self.capture_s = time.perf_counter() - started
        self.steps: list[tuple[float, int, int]] = []  # (time, tokens, graph replays so far) at each step's outputs
        self.first_token: dict[str, float] = {}
        self._unfinished: set[str] = set()
        self._done = asyncio.Event()
        self._salt = 0

    def _on_step(self, outputs: list[SeqOutput]) -> None:
        now = time.perf_counter()
        self.steps.append((now, sum(len(o.token_ids) for o in outputs), self.runner.replays))
        for output in outputs:
            self.first_token.setdefault(output.id, now)
            if output.finish_reason:
                self._unfinished.discard(output.id)
        if not self._unfinished:
            self._done.set()

    async def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        """Add every prompt at once; returns (start, end) of the run."""
        self._salt += 1
        ids = [f"l{self._salt}-{i}" for i in range(len(prompts))]
        self._unfinished, self.steps, self.first_token = set(ids), [], {}
        self._done.clear()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        for request_id, prompt in zip(ids, prompts):
            self.engine.add(GenRequest(request_id, prompt, params))
        await self._done.wait()
        return start, time.perf_counter()

    async def decode_level(self, streams: int) -> dict:
        sizes = self.sizes
        prompts = random_prompts(self.model.config.vocab_size, streams, sizes.prompt_tokens, 1000 + streams)
        replays = self.runner.replays
        start, end = await self.run(prompts, sizes.new_tokens)
        steps = self.steps
        # a step of every stream's decode: a graph replay (a mixed step runs eagerly) that gave each stream a token
        full = [
            steps[i][0] - steps[i - 1][0]
            for i in range(1, len(steps))
            if steps[i][1] == streams and steps[i][2] > steps[i - 1][2]
        ]
        decode_tok_s = streams * len(full) / sum(full) if full else None
        return {
            "streams": streams, "decode_tok_s": decode_tok_s, "step_ms_median": 1000 * statistics.median(full) if full else None,
            "run_tok_s": streams * sizes.new_tokens / (end - start), "decode_steps": len(full),
            "graph_replays": self.runner.replays - replays,
        }  # fmt: skip

    async def prefill(self) -> dict:
        sizes, vocab = self.sizes, self.model.config.vocab_size
        long_prompt = random_prompts(vocab, 1, sizes.long_prompt, 7)
        start, _ = await self.run(long_prompt, 1)
        single = sizes.long_prompt / (min(self.first_token.values()) - start)
        batch = random_prompts(vocab, sizes.batch_prompts, sizes.prompt_tokens * 4, 8)
        start, _ = await self.run(batch, 1)
        ttft_last = max(self.first_token.values()) - start
        return {"long_prompt_tokens": sizes.long_prompt, "long_prompt_tok_s": single,
                "batch": f"{sizes.batch_prompts} x {sizes.prompt_tokens * 4}",
                "batch_tok_s": sizes.batch_prompts * sizes.prompt_tokens * 4 / ttft_last}  # fmt: skip

    async def __aenter__(self) -> EngineBench:
        self._task = asyncio.create_task(self.engine.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.engine.stop()
        await self._task


def _timed(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Mean milliseconds of fn() after one warm-up, the device drained around the loop."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    synchronize(device)
    return 1000 * (time.perf_counter() - start) / repeat


def step_anatomy(model: LoadedModel, sizes: Sizes, batch_size: int, context: int, repeat: int) -> dict:
    """One decode step of `batch_size` sequences at `context` tokens, its parts timed on a pool of its own."""
    device, config = model.device, model.config
    pages_per_seq = -(-(context + 1) // PAGE_SIZE)
    shape = (config.num_layers, batch_size * pages_per_seq, PAGE_SIZE, config.num_kv_heads, config.head_dim)
    kv = PagedKV(
        k=torch.randn(shape, dtype=model.dtype, device=device), v=torch.randn(shape, dtype=model.dtype, device=device)
    )
    tables = torch.arange(batch_size * pages_per_seq).view(batch_size, pages_per_seq)
    slots = tables[:, context // PAGE_SIZE] * PAGE_SIZE + context % PAGE_SIZE
    cpu = dict(input_ids=torch.randint(0, config.vocab_size, (batch_size,)), positions=torch.full((batch_size,), context),
               slots=slots, query_lens=[1] * batch_size, context_lens=[context + 1] * batch_size, page_tables=tables,
               logits_indices=torch.arange(batch_size))  # fmt: skip
    batch = StepBatch(**cpu)
    on_device = StepBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in cpu.items()})
    runner = GraphedStep(model.model, kv, max_batch=batch_size, num_kv_heads=config.num_kv_heads,
                         max_graph_context=max(sizes.max_graph_context, context + 1)).capture()  # fmt: skip
    plan = PagedDecode(on_device.page_tables, torch.full((batch_size,), context + 1, device=device), PAGE_SIZE,
                       num_splits=runner._splits(batch_size, context + 1))  # fmt: skip
    paged = PagedDecodeBatch(**{k: getattr(on_device, k) for k in cpu}, decode=plan)
    with torch.inference_mode():
        graph_ms = _timed(lambda: runner(batch, kv), device, repeat)
        eager_paged_ms = _timed(lambda: model.model(paged, kv), device, repeat)
        eager_gather_ms = _timed(lambda: model.model(on_device, kv), device, repeat)
        logits = runner(batch, kv)
        sample_ms = _timed(lambda: logits.argmax(dim=-1).tolist(), device, repeat)
    return {"batch": batch_size, "context": context, "graph_step_ms": graph_ms, "eager_paged_ms": eager_paged_ms,
            "eager_gather_sdpa_ms": eager_gather_ms, "argmax_to_host_ms": sample_ms}  # fmt: skip


def hf_measure(hf, sizes: Sizes, vocab: int, device: torch.device, record: Callable[[str, object], None]) -> None:
    """transformers generate on the same prompts; each figure recorded as soon as it is measured."""
    warm = torch.tensor(random_prompts(vocab, 1, 16, 1), device=device)
    hf.generate(warm, max_new_tokens=2, do_sample=False, pad_token_id=0)
    for streams in sizes.streams:
        prompts = torch.tensor(random_prompts(vocab, streams, sizes.prompt_tokens, 1000 + streams), device=device)

        def generate(tokens: int) -> float:
            synchronize(device)
            start = time.perf_counter()
            with torch.inference_mode():
                hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=tokens, min_new_tokens=tokens,
                            do_sample=False, pad_token_id=0)  # fmt: skip
            synchronize(device)
            return time.perf_counter() - start

        short, long = generate(2), generate(sizes.new_tokens)
        record(f"decode_{streams}", {"streams": streams, "decode_tok_s": streams * (sizes.new_tokens - 2) / (long - short),
                                     "run_tok_s": streams * sizes.new_tokens / long})  # fmt: skip
    long_prompt = torch.tensor(random_prompts(vocab, 1, sizes.long_prompt, 7), device=device)
    with torch.inference_mode():
        hf(long_prompt)
        synchronize(device)
        start = time.perf_counter()
        hf(long_prompt)
        synchronize(device)
    record("prefill", {"long_prompt_tok_s": sizes.long_prompt / (time.perf_counter() - start)})


def kernel_bench(
    device: torch.device, dtype: torch.dtype, record: Callable[[str, object], None], dry_run: bool
) -> None:
    """The paged decode (K/V write + attention) against the CPU path's gather + SDPA, at the two shapes' head layouts."""
    layouts = [("smollm2-135m", 3, 3, 64), ("llama-3.2-1b", 8, 4, 64)]
    cases = [(1, 512), (1, 4096), (64, 512), (256, 512), (256, 2048)] if not dry_run else [(2, 40)]
    for name, kv_heads, group, head_dim in layouts:
        for batch_size, context in cases:
            pages_per_seq = -(-context // PAGE_SIZE)
            num_pages = batch_size * pages_per_seq
            generator = torch.Generator(device=device).manual_seed(0)
            pool = (num_pages, PAGE_SIZE, kv_heads, head_dim)
            k_pool = torch.randn(pool, generator=generator, device=device, dtype=dtype)
            v_pool = torch.randn(pool, generator=generator, device=device, dtype=dtype)
            tables = torch.randperm(num_pages, generator=generator, device=device).view(batch_size, pages_per_seq)
            slots = tables[:, (context - 1) // PAGE_SIZE] * PAGE_SIZE + (context - 1) % PAGE_SIZE
            q = torch.randn((batch_size, kv_heads * group, head_dim), generator=generator, device=device, dtype=dtype)
            k = torch.randn((batch_size, kv_heads, head_dim), generator=generator, device=device, dtype=dtype)
            v = torch.randn((batch_size, kv_heads, head_dim), generator=generator, device=device, dtype=dtype)
            contexts = torch.full((batch_size,), context, device=device)
            plan = PagedDecode(
                tables, contexts, PAGE_SIZE, num_splits=choose_splits(batch_size, kv_heads, context, device)
            )
            step = StepBatch(input_ids=slots, positions=slots, slots=slots, query_lens=[1] * batch_size,
                             context_lens=[context] * batch_size, page_tables=tables, logits_indices=slots)  # fmt: skip
            gather_plan = plan_attention(step, PAGE_SIZE, device)
            with torch.inference_mode():
                paged = plan.attend(q, k, v, k_pool, v_pool, slots)
                gathered = paged_attention(q, k, v, k_pool, v_pool, slots, gather_plan)
                paged_ms = _timed(lambda: plan.attend(q, k, v, k_pool, v_pool, slots), device, 3 if dry_run else 50)
                gather_ms = _timed(
                    lambda: paged_attention(q, k, v, k_pool, v_pool, slots, gather_plan), device, 3 if dry_run else 50
                )
            kv_bytes = 2 * batch_size * context * kv_heads * head_dim * k_pool.element_size()
            record(f"{name}/b{batch_size}/ctx{context}", {
                "layout": name, "batch": batch_size, "context": context, "splits": plan.num_splits,
                "paged_ms": paged_ms, "gather_sdpa_ms": gather_ms, "speedup": gather_ms / paged_ms,
                "paged_kv_gb_s": kv_bytes / paged_ms / 1e6, "max_abs_diff": float((paged.float() - gathered.float()).abs().max()),
            })  # fmt: skip


def run_shape(shape: str, device: torch.device, record: Callable[[str, object], None], dry_run: bool) -> None:
    """The gpu_check phase of one shape: lmq's engine first (the figures that matter most), then transformers."""
    sizes = DRY_SIZES if dry_run else GPU_SIZES
    config = hf_config("tiny" if dry_run else shape, 8192)
    started = time.perf_counter()
    # on the engine's torch thread, as a worker loads: a second OpenMP pool on the main thread would slow CPU steps
    weights = compute_thread.run(random_weights, config, seed=0, device=device)
    model = compute_thread.run(lmq_model, config, weights, dtype=torch.bfloat16, device=device)
    record("model", {"shape": shape, "parameters": model.parameter_count, "build_s": time.perf_counter() - started,
                     "sizes": dataclasses.asdict(sizes)})  # fmt: skip

    async def engine_levels() -> None:
        async with EngineBench(model, sizes) as bench:
            record("graph_capture_s", bench.capture_s)
            for streams in sizes.streams:
                record(f"lmq_decode_{streams}", await bench.decode_level(streams))
            record("lmq_prefill", await bench.prefill())

    asyncio.run(engine_levels())
    for batch_size in (1, 64) if not dry_run else (1, 4):
        record(
            f"anatomy_{batch_size}",
            step_anatomy(model, sizes, batch_size, sizes.prompt_tokens + sizes.new_tokens, 5 if dry_run else 50),
        )
    hf = hf_model(config, weights, dtype=torch.bfloat16, device=device)
    hf_measure(hf, sizes, config["vocab_size"], device, lambda key, value: record(f"hf_{key}", value))
