"""The CUDA-graph runner's bucketing, padding and static buffers, on CPU (worker/cuda/graphs.py).

`EagerGraphs` stands in for CUDA graphs: a "replay" calls the captured function again over the same
static buffers, so everything but the capture itself runs here: which bucket a step takes, the
padding rows (slot -1, context 0: no K/V written, no page read), the host buffer and its one copy,
stale page-table columns, the eager fallbacks. The paged decode plan runs its torch reference on
CPU (the Triton kernel has its own test, tests/worker/cuda/test_paged_decode_interpret.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from tests.support.tiny_model import make_tiny_model
from worker.batch import PagedKV
from worker.cuda.graphs import EagerGraphs, GraphedStep, batch_buckets, graphed
from worker.cuda.paged_decode import PagedDecode, PagedDecodeBatch
from worker.model.loader import load_model

PAGE_SIZE = 4
NUM_PAGES = 64
SENTINEL = 7.0  # pages no sequence owns hold this; a padding row that wrote K/V would change it


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return load_model(
        str(make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=5)), dtype="float32", quant="none", device="cpu"
    )


def sentinel_kv(config) -> PagedKV:
    kv = allocate_kv(config, NUM_PAGES, PAGE_SIZE, torch.float32)
    kv.k.fill_(SENTINEL)
    kv.v.fill_(SENTINEL)
    return kv


def test_buckets_are_powers_of_two_up_to_the_maximum() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]


class Sequences:
    """Sequences with scattered pages, driven one step at a time through two models on two pools."""

    def __init__(self, rng: random.Random, count: int, vocab: int) -> None:
        free = list(range(1, NUM_PAGES - 1))  # the first and last pages stay unowned: slot 0 and slot -1 land there
        rng.shuffle(free)
        self.rng, self.vocab = rng, vocab
        self.tokens = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 9))] for _ in range(count)]
        self.pages = [[free.pop() for _ in range(5)] for _ in range(count)]  # room for 20 tokens each
        self.computed = [0] * count

    def owned_pages(self) -> set[int]:
        return {page for pages in self.pages for page in pages}

    def prefill(self) -> list[Chunk]:
        chunks = [Chunk(tokens, 0, pages) for tokens, pages in zip(self.tokens, self.pages)]
        self.computed = [len(tokens) for tokens in self.tokens]
        return chunks

    def decode(self, which: list[int]) -> list[Chunk]:
        chunks = []
        for index in which:
            token = self.rng.randrange(self.vocab)
            chunks.append(Chunk([token], self.computed[index], self.pages[index]))
            self.tokens[index].append(token)
            self.computed[index] += 1
        return chunks


def trimmed(chunks: list[Chunk]) -> list[Chunk]:
    """Each chunk's page list cut to the pages its context uses (build_step_batch's table width)."""
    return [Chunk(c.token_ids, c.start, c.pages[: -(-(c.start + len(c.token_ids)) // PAGE_SIZE)]) for c in chunks]


def test_graphed_decode_steps_match_the_plain_model_and_padding_writes_nothing(tiny) -> None:
    rng = random.Random(1)
    config = tiny.config
    plain_kv, graphed_kv = sentinel_kv(config), sentinel_kv(config)
    runner = GraphedStep(tiny.model, graphed_kv, max_batch=6, num_kv_heads=config.num_kv_heads,
                         max_graph_context=20, backend=EagerGraphs()).capture()  # fmt: skip
    assert sorted(runner.graphs) == [1, 2, 4, 6]
    seqs = Sequences(rng, 6, config.vocab_size)
    prefill = make_batch(seqs.prefill(), PAGE_SIZE)
    torch.testing.assert_close(runner(prefill, graphed_kv), tiny.model(prefill, plain_kv))
    assert runner.replays == 0 and runner.eager_steps == 1  # a prefill runs eagerly
    for size in [6, 1, 3, 5, 2, 6, 4, 1]:  # every bucket, most of them padded, tables growing and shrinking
        batch = make_batch(trimmed(seqs.decode(sorted(rng.sample(range(6), size)))), PAGE_SIZE)
        assert runner.bucket_for(batch) == next(b for b in runner.buckets if b >= size)
        torch.testing.assert_close(runner(batch, graphed_kv), tiny.model(batch, plain_kv), rtol=1e-4, atol=1e-4)
    assert runner.replays == 8
    unowned = sorted(set(range(NUM_PAGES)) - seqs.owned_pages())
    assert (graphed_kv.k[:, unowned] == SENTINEL).all() and (graphed_kv.v[:, unowned] == SENTINEL).all()
    torch.testing.assert_close(graphed_kv.k, plain_kv.k, rtol=1e-4, atol=1e-4)


def test_steps_the_graphs_do_not_cover_run_eagerly(tiny) -> None:
    rng = random.Random(2)
    config = tiny.config
    plain_kv, graphed_kv = sentinel_kv(config), sentinel_kv(config)
    runner = GraphedStep(tiny.model, graphed_kv, max_batch=2, num_kv_heads=config.num_kv_heads,
                         max_graph_context=8, backend=EagerGraphs()).capture()  # fmt: skip
    seqs = Sequences(rng, 4, config.vocab_size)
    prefill = make_batch(seqs.prefill(), PAGE_SIZE)
    runner(prefill, graphed_kv), tiny.model(prefill, plain_kv)
    cases = [
        trimmed(seqs.decode([0, 1, 2])),  # more sequences than the largest graph
        seqs.decode([0]),  # a page table wider than the graphs' (5 pages > 8 tokens / 4)
        trimmed(seqs.decode([1, 3])) + [Chunk([5, 6], 0, seqs.pages[2][:1])],  # a mixed step (a fresh chunk)
    ]
    for chunks in cases:
        batch = make_batch(chunks, PAGE_SIZE)
        assert runner.bucket_for(batch) is None
        torch.testing.assert_close(runner(batch, graphed_kv), tiny.model(batch, plain_kv), rtol=1e-4, atol=1e-4)
    assert runner.replays == 0 and runner.eager_steps == 4


def test_a_runner_refuses_another_pool(tiny) -> None:
    kv = sentinel_kv(tiny.config)
    runner = GraphedStep(tiny.model, kv, max_batch=1, num_kv_heads=tiny.config.num_kv_heads, backend=EagerGraphs())
    with pytest.raises(ValueError, match="another KV pool"):
        runner(make_batch([Chunk([1], 0, [0])], PAGE_SIZE), sentinel_kv(tiny.config))


def test_routing_hands_the_plan_to_the_paged_decode(tiny) -> None:
    """A PagedDecodeBatch's plan reaches the model's attention (paged_attention.py routes it)."""
    import worker.model.llama as llama

    plan = PagedDecode(torch.zeros((1, 1), dtype=torch.int64), torch.ones(1, dtype=torch.int64), PAGE_SIZE)
    one = torch.zeros(1, dtype=torch.int64)
    batch = PagedDecodeBatch(one, one, one, [1], [1], plan.page_tables, one, decode=plan)
    assert llama.plan_attention(batch, PAGE_SIZE, torch.device("cpu")) is plan
    assert llama.plan_attention(batch, PAGE_SIZE, torch.device("cpu"), 3).window == 3


def test_a_model_that_cannot_be_captured_keeps_running_eagerly(tiny) -> None:
    """The mixture-of-experts MLP reads token counts back to the host: its capture fails, its steps stay eager."""

    def reads_back_to_the_host(batch, kv):
        raise RuntimeError("operation not permitted when stream is capturing")

    kv = sentinel_kv(tiny.config)
    assert (
        graphed(reads_back_to_the_host, kv, max_batch=2, num_kv_heads=2, backend=EagerGraphs())
        is reads_back_to_the_host
    )
    assert isinstance(
        graphed(tiny.model, kv, max_batch=2, num_kv_heads=2, max_graph_context=8, backend=EagerGraphs()), GraphedStep
    )


def test_a_replayed_step_returns_logits_for_its_sampling_rows_only(tiny) -> None:
    """A one-token prompt chunk short of its prompt's end is a decode-shaped row that does not sample
    (the step backends name only sampling rows in logits_indices): the replay must drop its logits."""
    rng = random.Random(3)
    config = tiny.config
    plain_kv, graphed_kv = sentinel_kv(config), sentinel_kv(config)
    runner = GraphedStep(tiny.model, graphed_kv, max_batch=4, num_kv_heads=config.num_kv_heads,
                         max_graph_context=20, backend=EagerGraphs()).capture()  # fmt: skip
    seqs = Sequences(rng, 3, config.vocab_size)
    prefill = make_batch(seqs.prefill(), PAGE_SIZE)
    runner(prefill, graphed_kv), tiny.model(prefill, plain_kv)
    batch = make_batch(trimmed(seqs.decode([0, 1, 2])), PAGE_SIZE)
    batch.logits_indices = torch.tensor([0, 2])  # row 1 does not sample
    got = runner(batch, graphed_kv)
    assert runner.replays == 1 and got.shape[0] == 2
    torch.testing.assert_close(got, tiny.model(batch, plain_kv), rtol=1e-4, atol=1e-4)
