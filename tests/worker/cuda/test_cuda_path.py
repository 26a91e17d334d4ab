"""The CUDA path against references computed on the same machine: skipped where CUDA is absent.

Random weights with a real shape (bench/engine/random_models.py; SmolLM2-135M's by default) built three
ways: bfloat16 and float32 on the GPU, float32 on the CPU; transformers' Llama holds the same
tensors. Decode steps go through the production path: CUDA graphs (worker/cuda/graphs.py) and the
paged decode kernel (worker/cuda/paged_decode.py).

Tolerances are relative L2 errors of a row of logits, ||got - want|| / ||want||:

- bfloat16 against float32: TOL_BF16 = 0.08. On this shape (30 layers, logits of standard deviation
  3) the CPU's own bfloat16 model is 0.023-0.026 from float32; the GPU gets three times that.
- two computations of the same thing in the same dtype (batched vs alone, prefix hit vs miss,
  chunked vs not, graph vs eager, lmq vs transformers in float32): float32 within 1e-3, bfloat16
  within 0.05 (the kernels differ with the batch's shape and each rounding travels through every
  layer: graph vs eager measured 0.019 on the CPU, where the paged plan attends in float32 and the
  eager path in bfloat16). A wrong page, mask or position moves the logits by tens of percent, and
  the float32 runs see anything above rounding.
- greedy tokens: equal, except where the float32 reference's margin between its choice and the
  GPU's is within twice that row's largest logit error (a near-tie).

LMQ_CUDA_TEST_DEVICE=cpu LMQ_CUDA_TEST_SHAPE=tiny runs the same code on a CPU (the graphs' CPU
stand-in, the decode's torch reference): how this file itself is checked without a GPU.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from bench.engine.random_models import hf_config, hf_model, lmq_model, random_weights
from protocol import SamplingParams
from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from worker import compute_thread
from worker.batch import PagedKV
from worker.cuda.graphs import GraphedStep, to_device
from worker.engine import Engine, GenRequest
from worker.model.loader import LoadedModel

DEVICE = torch.device(os.environ.get("LMQ_CUDA_TEST_DEVICE", "cuda"))
SHAPE = os.environ.get("LMQ_CUDA_TEST_SHAPE", "smollm2-135m")
MAX_CONTEXT = 1024
PAGE_SIZE = 16
NUM_PAGES = 160
TOL_BF16 = 0.08
TOL_SAME = {torch.float32: 1e-3, torch.bfloat16: 0.05}
DTYPES = [torch.float32, torch.bfloat16]

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def config() -> dict:
    return hf_config(SHAPE, MAX_CONTEXT)


@pytest.fixture(scope="module")
def weights(config: dict) -> dict[str, torch.Tensor]:
    return random_weights(config, seed=0)


@pytest.fixture(scope="module")
def models(config: dict, weights: dict[str, torch.Tensor]) -> dict[torch.dtype, LoadedModel]:
    """The model on the device under test in each dtype."""
    return {dtype: lmq_model(config, weights, dtype=dtype, device=DEVICE) for dtype in DTYPES}


@pytest.fixture(scope="module")
def cpu_reference(config: dict, weights: dict[str, torch.Tensor]) -> LoadedModel:
    return lmq_model(config, weights, dtype=torch.float32, device="cpu")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per row: ||got - want|| / ||want||, on the CPU in float32."""
    got, want = got.float().cpu(), want.float().cpu()
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


class Run:
    """One model on a pool of its own; sequences own disjoint pages taken from a shuffled list."""

    def __init__(self, model: LoadedModel, *, graphs: bool, max_batch: int = 16, seed: int = 0) -> None:
        self.model = model
        self.kv: PagedKV = allocate_kv(model.config, NUM_PAGES, PAGE_SIZE, model.dtype, model.device)
        self.forward = model.model
        if graphs:
            runner = GraphedStep(model.model, self.kv, max_batch=max_batch, num_kv_heads=model.config.num_kv_heads,
                                 max_graph_context=MAX_CONTEXT)  # fmt: skip
            self.forward = runner.capture()
        self.free = list(range(NUM_PAGES))
        random.Random(seed).shuffle(self.free)

    def pages(self, tokens: int) -> list[int]:
        return [self.free.pop() for _ in range(-(-tokens // PAGE_SIZE))]

    def step(self, chunks: list[Chunk], on_device: bool = False) -> torch.Tensor:
        """Logits of each chunk's last token; each chunk's page list is cut to its context, as the engine does.

        on_device: the batch's tensors already on the model's device (as the engine builds them today)
        rather than on the host (as it builds them for the graphs once integrated: docs/gpu.md).
        """
        chunks = [Chunk(c.token_ids, c.start, c.pages[: -(-(c.start + len(c.token_ids)) // PAGE_SIZE)]) for c in chunks]
        batch = make_batch(chunks, PAGE_SIZE)
        if on_device:
            batch = to_device(batch, self.model.device)
        with torch.inference_mode():
            return self.forward(batch, self.kv).float().clone()


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def decode_chunks(sequences: list[list[int]], pages: list[list[int]], tokens: list[int]) -> list[Chunk]:
    """Append tokens[i] to sequence i and return the decode chunks for them."""
    for seq, token in zip(sequences, tokens):
        seq.append(token)
    return [Chunk([seq[-1]], len(seq) - 1, seq_pages) for seq, seq_pages in zip(sequences, pages)]


def test_bf16_on_the_device_matches_float32_on_the_cpu(models, cpu_reference, record_property) -> None:
    device, reference = Run(models[torch.bfloat16], graphs=True), Run(cpu_reference, graphs=False)
    sequences = prompts(cpu_reference.config.vocab_size, [5, 37, 120, 64])
    pages = [device.pages(len(s) + 16) for s in sequences]
    chunks = [Chunk(list(s), 0, p) for s, p in zip(sequences, pages)]
    got, want = device.step(chunks), reference.step(chunks)
    errors, mismatches, near_ties = [rel_err(got, want)], 0, 0
    for _ in range(12):  # teacher-forced with the device's choices, so both follow the same sequences
        chosen = got.argmax(dim=-1).cpu()
        best = want.argmax(dim=-1)
        for row in range(len(sequences)):
            if chosen[row] != best[row]:
                margin = want[row, best[row]] - want[row, chosen[row]]
                if margin <= 2 * (got[row].cpu() - want[row]).abs().max():
                    near_ties += 1
                else:
                    mismatches += 1
        chunks = decode_chunks(sequences, pages, chosen.tolist())
        got, want = device.step(chunks), reference.step(chunks)
        errors.append(rel_err(got, want))
    worst = float(torch.stack(errors).max())
    record_property("rel_err_max", worst)
    record_property("greedy_near_ties", near_ties)
    assert worst <= TOL_BF16
    assert mismatches == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_sequence_batched_matches_it_alone(models, dtype, record_property) -> None:
    model = models[dtype]
    alone, batched = Run(model, graphs=True), Run(model, graphs=True, seed=1)
    sequences = prompts(model.config.vocab_size, [50, 9, 77, 30, 3, 61])
    alone_seq = [list(sequences[0])]
    alone_pages = [alone.pages(80)]
    batch_pages = [batched.pages(len(s) + 16) for s in sequences]
    got = batched.step([Chunk(list(s), 0, p) for s, p in zip(sequences, batch_pages)])[:1]
    want = alone.step([Chunk(list(alone_seq[0]), 0, alone_pages[0])])
    errors = [rel_err(got, want)]
    for step in range(8):
        tokens = [(7 * step + 3 * i) % model.config.vocab_size for i in range(len(sequences))]
        got = batched.step(decode_chunks(sequences, batch_pages, tokens))[:1]
        want = alone.step(decode_chunks(alone_seq, alone_pages, tokens[:1]))
        errors.append(rel_err(got, want))
    worst = float(torch.cat(errors).max())
    record_property(f"rel_err_max_{str(dtype).removeprefix('torch.')}", worst)
    assert worst <= TOL_SAME[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_prefix_cache_hit_matches_a_miss(models, dtype, record_property) -> None:
    """The hit reuses the donor's first three pages and computes only its own tail, as the engine does."""
    model = models[dtype]
    run = Run(model, graphs=True)
    prompt = prompts(model.config.vocab_size, [3 * PAGE_SIZE + 10])[0]
    donor_pages, miss_pages = run.pages(len(prompt) + 8), run.pages(len(prompt) + 8)
    run.step([Chunk(prompt[: 3 * PAGE_SIZE] + [1, 2, 3], 0, donor_pages)])  # the donor: same first pages, other tail
    hit_pages = donor_pages[:3] + run.pages(len(prompt) + 8 - 3 * PAGE_SIZE)
    hit, miss = [list(prompt)], [list(prompt)]
    got = run.step([Chunk(prompt[3 * PAGE_SIZE :], 3 * PAGE_SIZE, hit_pages)])
    want = run.step([Chunk(list(prompt), 0, miss_pages)])
    errors = [rel_err(got, want)]
    for step in range(4):
        got = run.step(decode_chunks(hit, [hit_pages], [step + 11]))
        want = run.step(decode_chunks(miss, [miss_pages], [step + 11]))
        errors.append(rel_err(got, want))
    worst = float(torch.cat(errors).max())
    record_property(f"rel_err_max_{str(dtype).removeprefix('torch.')}", worst)
    assert worst <= TOL_SAME[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_chunked_prompt_matches_one_chunk(models, dtype, record_property) -> None:
    model = models[dtype]
    run = Run(model, graphs=True)
    prompt = prompts(model.config.vocab_size, [100], seed=3)[0]
    chunked_pages, whole_pages = run.pages(110), run.pages(110)
    for start, end in [(0, 37), (37, 74)]:  # chunks that end inside pages
        run.step([Chunk(prompt[start:end], start, chunked_pages)])
    got = run.step([Chunk(prompt[74:], 74, chunked_pages)])
    want = run.step([Chunk(list(prompt), 0, whole_pages)])
    chunked, whole = [list(prompt)], [list(prompt)]
    errors = [rel_err(got, want)]
    for step in range(4):
        got = run.step(decode_chunks(chunked, [chunked_pages], [step + 5]))
        want = run.step(decode_chunks(whole, [whole_pages], [step + 5]))
        errors.append(rel_err(got, want))
    worst = float(torch.cat(errors).max())
    record_property(f"rel_err_max_{str(dtype).removeprefix('torch.')}", worst)
    assert worst <= TOL_SAME[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_graph_replays_match_the_eager_model(models, dtype, record_property) -> None:
    """Graphs with the paged kernel against the model's own eager path (gather + SDPA), batch sizes off the buckets."""
    model = models[dtype]
    graphed, eager = Run(model, graphs=True, max_batch=16), Run(model, graphs=False)
    sequences = prompts(model.config.vocab_size, [17, 3, 40, 64, 1, 33, 16, 90, 5, 48, 22, 7, 15], seed=4)
    pages = [graphed.pages(len(s) + 24) for s in sequences]
    chunks = [Chunk(list(s), 0, p) for s, p in zip(sequences, pages)]
    errors = [rel_err(graphed.step(chunks), eager.step(chunks))]
    rng = random.Random(5)
    for index, size in enumerate([1, 3, 8, 13, 2, 13]):
        which = sorted(rng.sample(range(len(sequences)), size))
        tokens = [rng.randrange(model.config.vocab_size) for _ in which]
        chosen = [sequences[i] for i in which]
        chunks = decode_chunks(chosen, [pages[i] for i in which], tokens)
        on_device = index % 2 == 1  # the graphs' inputs sent from the host, then copied on the device
        errors.append(rel_err(graphed.step(chunks, on_device), eager.step(chunks)))
    assert graphed.forward.replays == 6
    worst = float(torch.cat(errors).max())
    record_property(f"rel_err_max_{str(dtype).removeprefix('torch.')}", worst)
    assert worst <= TOL_SAME[dtype]


def transformers_error(model: LoadedModel, reference) -> float:
    """The largest relative error of lmq's logits (prefill, then 4 graphed decodes) against transformers' forward."""
    run = Run(model, graphs=True)
    sequence = prompts(model.config.vocab_size, [40], seed=6)[0]
    pages = run.pages(60)
    got = [run.step([Chunk(list(sequence), 0, pages)])]
    for step in range(4):
        got.append(run.step(decode_chunks([sequence], [pages], [100 + step])))
    with torch.inference_mode():
        want = reference(torch.tensor([sequence], device=model.device)).logits[0, -5:].float()
    return float(rel_err(torch.cat(got), want).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_matches_transformers_with_the_same_weights(config, weights, models, dtype, record_property) -> None:
    worst = transformers_error(models[dtype], hf_model(config, weights, dtype=dtype, device=DEVICE))
    record_property(f"rel_err_max_{str(dtype).removeprefix('torch.')}", worst)
    tolerance = TOL_SAME[dtype] if dtype == torch.float32 else TOL_BF16  # bfloat16: two roundings of their own
    assert worst <= tolerance


@pytest.mark.skipif(DEVICE.type != "cuda", reason="a 1B model in float32 is for the GPU")
def test_the_1b_shape_matches_transformers_in_float32(record_property) -> None:
    """Llama 3.2's shape: 8 KV heads for 32 query heads, llama3 rope scaling, a 128k vocabulary."""
    config = hf_config("llama-3.2-1b", 8192)
    weights = random_weights(config, seed=1, device=DEVICE)
    model = lmq_model(config, weights, dtype=torch.float32, device=DEVICE)
    worst = transformers_error(model, hf_model(config, weights, dtype=torch.float32, device=DEVICE))
    record_property("rel_err_max_float32", worst)
    assert worst <= TOL_SAME[torch.float32]


def graphed_engine(model: LoadedModel, on_step, **options) -> tuple[Engine, GraphedStep]:
    """An engine whose model steps through CUDA graphs (wrapped here unless the engine already does it)."""
    engine = Engine(model, on_step=on_step, **options)
    if not isinstance(engine.backend.model, GraphedStep):
        runner = GraphedStep(engine.backend.model, engine.kv.kv, max_batch=engine.scheduler.max_seqs,
                             num_kv_heads=model.config.num_kv_heads, max_graph_context=MAX_CONTEXT)  # fmt: skip
        compute_thread.run(runner.capture)
        engine.backend.model = runner
    return engine, engine.backend.model


def test_the_page_pool_leaks_nothing_after_a_random_workload(models, record_property) -> None:
    """Arrivals over time, shared prefixes, cancellations and a pool small enough to preempt."""
    model = models[torch.bfloat16]
    rng = random.Random(7)
    vocab = model.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(40)]
    finishes: dict[str, int] = {}

    def on_step(outputs) -> None:
        for output in outputs:
            if output.finish_reason is not None:
                finishes[output.id] = finishes.get(output.id, 0) + 1

    page_bytes = 2 * model.config.num_layers * PAGE_SIZE * model.config.num_kv_heads * model.config.head_dim * 2
    engine, runner = graphed_engine(model, on_step, kv_memory_bytes=48 * page_bytes, page_size=PAGE_SIZE, max_seqs=12)

    async def workload() -> None:
        task = asyncio.create_task(engine.run())
        ids = []
        for index in range(36):
            prompt = (shared if index % 3 == 0 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 200))]
            temperature = 0.0 if index % 2 else 0.8
            params = SamplingParams(
                max_tokens=rng.randrange(1, 30), temperature=temperature, seed=index, ignore_eos=True
            )
            engine.add(GenRequest(f"r{index}", prompt, params))
            ids.append(f"r{index}")
            if index % 5 == 4:
                engine.cancel(ids[rng.randrange(len(ids))])
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01]))
        while len(finishes) < len(ids):
            await asyncio.sleep(0.01)
        engine.stop()
        await asyncio.wait_for(task, 60)

    asyncio.run(asyncio.wait_for(workload(), 240))
    stats = engine.stats
    record_property("preemptions", stats.preemptions)
    record_property("graph_replays", runner.replays)
    assert all(count == 1 for count in finishes.values())
    assert stats.kv_pages_used == 0 and stats.kv_pages_free == stats.kv_pages_total
    assert runner.replays > 0
