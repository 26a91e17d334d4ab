"""The native step (worker/runtime/native_step.py, through the cpu-native backend) against float32 and against the torch path it replaces.

It serves the default model's steps in the default CPU mode, so it is held to the same quality bar as
bfloat16/int4 (tests/worker/model/test_reference.py, whose teacher forcing is one prompt chunk) over teacher-forced
decode steps too. Its rows never share arithmetic; in the invariant mode (cpu_steps="invariant": every
step on VNNI) a sequence's logits are bit-identical whatever it is batched with, however its prompt is
chunked, and on any thread count. The default mode runs steps of AMX_FROM_ROWS rows and more on AMX
tiles where the CPU has them: close to VNNI's, and invariant among such steps; below them (or on every CPU
without tiles) steps of INT8_FROM_ROWS rows and more on int8 x (held to the same quality bar) wherever they
sample no prompt's last row: batched decodes, a long prompt's chunks but the row that gives its first token.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.engine.quality import chat_logits, compare
from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from tests.support.reference_data import load_reference
from tests.worker.model.test_reference import LIMITS
from worker.batch import PagedKV
from worker.model.loader import DENSE_FROM_ROWS, LoadedModel, load_model
from worker.model.quant_linear import TieredLinear
from worker.native import build
from worker.runtime.cpu_native import CpuNativeBackend
from worker.runtime.long_prompts import LONG_PROMPT_ROWS
from worker.runtime.native_step import AMX_FROM_ROWS, INT8_FROM_ROWS, NativeSteps, amx_usable
from worker.runtime.select import select_backend

PAGE = 16

pytestmark = [
    pytest.mark.skipif(
        build.missing_requirements() is not None, reason=f"native decode step: {build.missing_requirements()}"
    ),
    pytest.mark.slow,  # every test here runs the real default model
]


def _native_backend(loaded: LoadedModel) -> CpuNativeBackend:
    backend = select_backend(loaded, max_threads=torch.get_num_threads())
    assert isinstance(backend, CpuNativeBackend), "the selector picks the native step where the CPU has VNNI and g++"
    return backend


@pytest.fixture(scope="module")
def int4_model() -> CpuNativeBackend:
    return _native_backend(load_model(dtype="bfloat16", quant="int4", device="cpu"))


@pytest.fixture(scope="module")
def invariant_model() -> CpuNativeBackend:
    backend = _native_backend(load_model(dtype="bfloat16", quant="int4", device="cpu", cpu_steps="invariant"))
    native = backend.native
    assert native.max_rows is None and native.struct.amx_from_rows == 0, "every step native, none on tiles"
    return backend


def _tiles_here(backend: CpuNativeBackend) -> bool:
    return amx_usable(backend.native.library)


def _teacher_forced_decodes(backend: CpuNativeBackend, cases: list[dict]) -> list[torch.Tensor]:
    """Per case, logits [32, vocab]: its prompt in one prefill, then each reference token as a decode step, all cases together."""
    per_seq = max(-(-(len(case["prompt_ids"]) + len(case["greedy_ids"])) // PAGE) for case in cases)
    kv = allocate_kv(backend.config, num_pages=per_seq * len(cases), page_size=PAGE, dtype=torch.bfloat16)
    pages = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(cases))]
    logits = backend.forward(make_batch([Chunk(case["prompt_ids"], 0, p) for case, p in zip(cases, pages)], PAGE), kv)
    rows: list[list[torch.Tensor]] = [[row] for row in logits]
    native = backend.native
    for step in range(len(cases[0]["greedy_ids"]) - 1):
        chunks = [Chunk([case["greedy_ids"][step]], len(case["prompt_ids"]) + step, p) for case, p in zip(cases, pages)]
        batch = make_batch(chunks, PAGE)
        assert native.takes(batch, kv)
        for out, row in zip(rows, backend.forward(batch, kv)):
            out.append(row)
    return [torch.stack(out) for out in rows]


@pytest.mark.slow
def test_native_steps_stay_close_to_float32(int4_model: CpuNativeBackend, default_model: LoadedModel) -> None:
    reference = load_reference()
    float32 = default_model  # the session's float32 load (tests/conftest.py)
    base = chat_logits(float32, reference["chat"])
    native = _teacher_forced_decodes(int4_model, reference["chat"])
    quality = compare(base, native)
    limits = LIMITS[("bfloat16", "int4")]
    assert quality.positions == 5 * 32 and quality.clear_positions > 100, quality
    assert quality.mean_kl < limits.max_mean_kl, quality
    assert quality.max_kl < limits.max_kl, quality
    assert quality.clear_top1 >= limits.min_clear_top1, quality


def test_decodes_on_int8_x_stay_close_to_float32(int4_model: CpuNativeBackend, default_model: LoadedModel) -> None:
    """The int8 tier under the bar of every bfloat16/int4 step, teacher-forced: the prompt as a prompt (int16 x),
    each reference token a decode on int8 x (forced on for the 5 cases' 5-row steps)."""
    reference = load_reference()
    base = chat_logits(default_model, reference["chat"])
    native = int4_model.native
    native.struct.int8_from_rows = 1
    try:
        decodes = _teacher_forced_decodes(int4_model, reference["chat"])
    finally:
        native.struct.int8_from_rows = INT8_FROM_ROWS
    quality = compare(base, decodes)
    limits = LIMITS[("bfloat16", "int4")]
    assert quality.mean_kl < limits.max_mean_kl, quality
    assert quality.max_kl < limits.max_kl, quality
    assert quality.clear_top1 >= limits.min_clear_top1, quality


def _decode_logits(
    backend: CpuNativeBackend,
    kv: PagedKV,
    prompts: list[list[int]],
    rows: list[int],
    threads: int | None = None,
    prompt_ends: int = 0,
) -> torch.Tensor:
    """One decode step of `rows` (indices into prompts, each prefilled in its own pages) on a copy of kv;
    prompt_ends: how many of them (the first) the batch says are a prompt's last token (its one row this step)."""
    native = backend.native
    kv = PagedKV(k=kv.k.clone(), v=kv.v.clone())
    batch = make_batch([Chunk([7], len(prompts[r]), list(range(r * 4, r * 4 + 4))) for r in rows], PAGE)
    batch = dataclasses.replace(batch, prompt_ends=[i < prompt_ends for i in range(len(rows))])
    saved = native.threads
    native.threads = threads or saved
    try:
        return native.forward(batch, kv)
    finally:
        native.threads = saved


def _decode_logits_with(backend: CpuNativeBackend, kv: PagedKV, prompts: list[list[int]], rows: list[int], **fields):
    """_decode_logits with the model struct's `fields` (amx_from_rows, int8_from_rows) set for this step only."""
    struct = backend.native.struct
    saved = {name: getattr(struct, name) for name in fields}
    for name, value in fields.items():
        setattr(struct, name, value)
    try:
        return _decode_logits(backend, kv, prompts, rows)
    finally:
        for name, value in saved.items():
            setattr(struct, name, value)


def _max_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """The largest KL(p || q) over the rows of two logit tensors."""
    return float((p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1).max())


@pytest.fixture(scope="module")
def prefilled(int4_model: CpuNativeBackend) -> tuple[PagedKV, list[list[int]]]:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (20 + 9 * i,), generator=generator).tolist() for i in range(5)]
    kv = allocate_kv(int4_model.config, num_pages=4 * len(prompts), page_size=PAGE, dtype=torch.bfloat16)
    int4_model.forward(
        make_batch([Chunk(p, 0, list(range(i * 4, i * 4 + 4))) for i, p in enumerate(prompts)], PAGE), kv
    )
    return kv, prompts


def test_a_sequence_gets_the_same_logits_whatever_it_is_batched_with(
    invariant_model: CpuNativeBackend, prefilled
) -> None:
    kv, prompts = prefilled
    alone = _decode_logits(invariant_model, kv, prompts, [2])
    for rows in ([0, 1, 2, 3, 4], [2, 4], [4, 3, 2, 1, 0, 0, 1, 3, 4], [0, 1, 2, 3, 4] * 4):
        batched = _decode_logits(invariant_model, kv, prompts, rows)
        assert torch.equal(batched[rows.index(2)], alone[0]), rows


def test_thread_count_does_not_change_the_logits(int4_model: CpuNativeBackend, prefilled) -> None:
    kv, prompts = prefilled
    for rows in ([0, 1, 2, 3, 4], [0, 1, 2, 3, 4] * 2):  # VNNI, and AMX tiles where the CPU has them
        one, two = (_decode_logits(int4_model, kv, prompts, rows, threads) for threads in (1, 2))
        assert torch.equal(one, two), len(rows)


# The default mode's tiers for large steps: (the struct's field, its value, whether it needs AMX tiles, a decode
# on the tier, and other steps on it holding sequence 2: one of the tier's smallest size and a larger one). On a
# CPU with tiles int8 x serves the steps below them.
LARGE_STEP_TIERS = {
    "AMX tiles": (
        "amx_from_rows",
        AMX_FROM_ROWS,
        True,
        [0, 1, 2, 3, 4] * 3,
        ([2, 0, 1, 3, 4, 4] + [0, 1, 3, 4] * 2, [4, 3, 2, 1, 0] * 3 + [2]),
    ),
    "int8 x": (
        "int8_from_rows",
        INT8_FROM_ROWS,
        False,
        [0, 1, 2, 3, 4] * 2,
        ([2, 0, 1, 3, 4], [4, 3, 2, 1, 0] * 2 + [2]),
    ),
}


@pytest.mark.parametrize("tier", LARGE_STEP_TIERS)
def test_a_tier_of_large_steps_stays_close_to_int16_x_and_invariant_among_its_steps(
    int4_model: CpuNativeBackend, prefilled, tier: str
) -> None:
    """A decode on the tier against the same step on int16 x (every tier off): it ran, it is close, and a row's
    logits are the same in any step of the tier (a row's products are its own); a step one row smaller is not on it."""
    field, value, needs_tiles, rows, others = LARGE_STEP_TIERS[tier]
    if needs_tiles and not _tiles_here(int4_model):
        pytest.skip(f"{tier} do not serve this CPU's large steps")
    kv, prompts = prefilled
    assert getattr(int4_model.native.struct, field) == value
    on_tier = _decode_logits(int4_model, kv, prompts, rows)
    int16 = _decode_logits_with(int4_model, kv, prompts, rows, amx_from_rows=0, int8_from_rows=0)
    assert not torch.equal(on_tier, int16), f"{tier} ran"
    assert _max_kl(int16, on_tier) < 0.02
    for step in others:
        batched = _decode_logits(int4_model, kv, prompts, step)
        assert torch.equal(batched[step.index(2)], on_tier[2]), len(step)
    smaller = rows[: value - 1]
    assert torch.equal(
        _decode_logits(int4_model, kv, prompts, smaller),
        _decode_logits_with(int4_model, kv, prompts, smaller, **{field: 0}),
    )


def test_a_prompt_row_among_decodes_keeps_the_step_on_int16_x(int4_model: CpuNativeBackend, prefilled) -> None:
    """A prompt whose one row this step is its last token (the rest cached, or its last chunk one token long)
    is batched like a decode, but that row gives the answer's first token: the whole step stays on int16."""
    kv, prompts = prefilled
    rows = [0, 1, 2, 3, 4] * 2
    with_a_prompt = _decode_logits(int4_model, kv, prompts, rows, prompt_ends=1)
    assert torch.equal(with_a_prompt, _decode_logits_with(int4_model, kv, prompts, rows, int8_from_rows=0))
    assert not torch.equal(with_a_prompt, _decode_logits(int4_model, kv, prompts, rows)), "all decodes: int8 x"


def test_where_tiles_serve_a_model_decodes_below_them_take_int8_x(int4_model: CpuNativeBackend) -> None:
    """Tiles pay from AMX_FROM_ROWS rows against int8 x (native_step.py has the measurements): a model on tiles
    keeps the int8 tier for the decodes below them. Built, not run: on a CPU without tiles a step of this
    struct would reach for them."""
    loaded = int4_model.loaded
    tiles = NativeSteps(
        int4_model.native.library, loaded.model, loaded.checkpoint, 2, None, AMX_FROM_ROWS, INT8_FROM_ROWS
    )
    assert (tiles.struct.amx_from_rows, tiles.struct.int8_from_rows) == (AMX_FROM_ROWS, INT8_FROM_ROWS)
    vnni = NativeSteps(int4_model.native.library, loaded.model, loaded.checkpoint, 2, None, 0, INT8_FROM_ROWS)
    assert vnni.struct.int8_from_rows == INT8_FROM_ROWS


def test_a_short_prompts_last_chunk_keeps_every_row_on_int16_x(int4_model: CpuNativeBackend, prefilled) -> None:
    """Its last row gives the answer's first token (decoder_step.cpp says why), and a short prompt's earlier rows
    stay on int16 too (worker/runtime/long_prompts.py: near-tied short answers flip on int8 context)."""
    if _tiles_here(int4_model):
        pytest.skip("a chunk of 40 rows runs on AMX tiles on this CPU")
    _, prompts = prefilled
    native = int4_model.native
    kv = allocate_kv(int4_model.config, num_pages=4, page_size=PAGE, dtype=torch.bfloat16)
    chunk = make_batch([Chunk(prompts[4][:40], 0, [0, 1, 2, 3])], PAGE)
    with_tier = native.forward(chunk, PagedKV(k=kv.k.clone(), v=kv.v.clone()))
    saved, native.struct.int8_from_rows = native.struct.int8_from_rows, 0
    try:
        without = native.forward(chunk, PagedKV(k=kv.k.clone(), v=kv.v.clone()))
    finally:
        native.struct.int8_from_rows = saved
    assert torch.equal(with_tier, without)


def test_a_chunk_that_samples_nothing_runs_on_int8_x(int4_model: CpuNativeBackend) -> None:
    """A long prompt's earlier chunk: no row of it gives a token, so its K/V come from int8 x, close to int16's."""
    if _tiles_here(int4_model):
        pytest.skip("a chunk of 40 rows runs on AMX tiles on this CPU")
    native, prompt = int4_model.native, list(range(1000, 1040))
    chunk = make_batch([Chunk(prompt, 0, [0, 1, 2], samples=False)], PAGE)
    on_tier, int16 = (allocate_kv(int4_model.config, num_pages=3, page_size=PAGE, dtype=torch.bfloat16) for _ in "ab")
    assert native.forward(chunk, on_tier).shape[0] == 0
    saved, native.struct.int8_from_rows = native.struct.int8_from_rows, 0
    try:
        native.forward(chunk, int16)
    finally:
        native.struct.int8_from_rows = saved
    assert not torch.equal(on_tier.k, int16.k)
    last_layer = (on_tier.v[-1].float() - int16.v[-1].float()).norm() / int16.v[-1].float().norm()
    assert last_layer < 0.1, last_layer


@pytest.mark.skipif("avx512_bf16" not in build.cpu_flags(), reason="no AVX512-BF16 on this CPU")
def test_a_chunk_that_samples_nothing_attends_in_bfloat16_products_close_to_float32(
    int4_model: CpuNativeBackend,
) -> None:
    """Its tiles attend in bfloat16 products (worker/native/prompt_attention_bf16.h): every layer's K/V within 8%
    of the float32 tiles' (Model::bf16_attention off, as on a CPU without AVX512-BF16; 0.8-3.4% measured). Real
    text, so that heads attend to a few keys: a key paired with the wrong value or a score with the wrong key's
    dimensions moved them 20-150% (a tiny random model's near-uniform attention hides both)."""
    if _tiles_here(int4_model):
        pytest.skip("a chunk of this size runs on AMX tiles on this CPU")
    native = int4_model.native
    text = (
        "The old lighthouse keeper climbed the stairs every evening, counting each step as his father had taught him. "
    )
    prompt = int4_model.loaded.checkpoint.tokenizer.encode(text * 3).ids[:90]
    pages = list(range(-(-len(prompt) // PAGE)))
    chunk = make_batch([Chunk(prompt, 0, pages, samples=False)], PAGE)
    products, float32 = (allocate_kv(int4_model.config, len(pages), PAGE, torch.bfloat16) for _ in "ab")
    assert native.struct.bf16_attention == 1
    native.forward(chunk, products)
    native.struct.bf16_attention = 0
    try:
        native.forward(chunk, float32)
    finally:
        native.struct.bf16_attention = 1
    assert not torch.equal(products.v, float32.v)
    for layer in range(int4_model.config.num_layers):
        for got, want in ((products.k[layer], float32.k[layer]), (products.v[layer], float32.v[layer])):
            error = (got.float() - want.float()).norm() / want.float().norm()
            assert error < 0.08, (layer, float(error))


def test_a_long_prompts_last_chunk_runs_all_but_its_sampled_row_on_int8_x(int4_model: CpuNativeBackend) -> None:
    """The step runs as two: every row but the last (int8 x, sampling nothing), then the last alone (int16 x),
    attending to what the first wrote: the same logits and K/V as those two steps by hand, close to all-int16's."""
    if _tiles_here(int4_model):
        pytest.skip("long prompts run on AMX tiles on this CPU")
    native = int4_model.native
    prompt = torch.randint(100, 40000, (LONG_PROMPT_ROWS + 8,), generator=torch.Generator().manual_seed(5)).tolist()
    pages = list(range(-(-len(prompt) // PAGE)))
    split, by_hand, int16 = (allocate_kv(int4_model.config, len(pages), PAGE, torch.bfloat16) for _ in "abc")
    logits = native.forward(make_batch([Chunk(prompt, 0, pages)], PAGE), split)
    native.forward(make_batch([Chunk(prompt[:-1], 0, pages, samples=False)], PAGE), by_hand)
    last = dataclasses.replace(make_batch([Chunk(prompt[-1:], len(prompt) - 1, pages)], PAGE), prompt_ends=[True])
    assert torch.equal(logits, native.forward(last, by_hand))
    assert torch.equal(split.k, by_hand.k) and torch.equal(split.v, by_hand.v)
    saved, native.struct.int8_from_rows = native.struct.int8_from_rows, 0
    try:
        all_int16 = native.forward(make_batch([Chunk(prompt, 0, pages)], PAGE), int16)
    finally:
        native.struct.int8_from_rows = saved
    assert not torch.equal(logits, all_int16), "the earlier rows ran on int8 x"
    assert _max_kl(all_int16, logits) < 0.02 and logits.argmax() == all_int16.argmax()


def test_without_tiles_the_native_step_serves_long_prompts_and_the_dense_copies_go() -> None:
    """The default CPU mode packs bfloat16 copies for long prompts; on a CPU without AMX the native step's int8 x
    is faster for them (docs/benchmarks.md), so it takes every step and the copies are let go."""
    loaded = load_model(device="cpu")  # dtype and quant auto: the loader packs the copies
    assert loaded.dense_from_rows == DENSE_FROM_ROWS
    native = _native_backend(loaded).native
    tiered = [module for module in loaded.model.modules() if isinstance(module, TieredLinear)]
    if amx_usable(native.library):
        assert native.max_rows == DENSE_FROM_ROWS and tiered
    else:
        assert native.max_rows is None and not tiered and loaded.dense_from_rows is None


@pytest.mark.parametrize("copies", [1, 2])  # 5 and 10 rows: int8 x (on AMX tiles at 10 where the CPU has them)
def test_native_step_writes_the_kv_and_logits_the_torch_path_would(
    int4_model: CpuNativeBackend, prefilled, copies: int
) -> None:
    kv, prompts = prefilled
    chunks = [Chunk([11], len(p), list(range(i * 4, i * 4 + 4))) for i, p in enumerate(prompts)]
    batch = make_batch(chunks * copies, PAGE)
    native_kv, torch_kv = PagedKV(k=kv.k.clone(), v=kv.v.clone()), PagedKV(k=kv.k.clone(), v=kv.v.clone())
    native_logits = int4_model.native.forward(batch, native_kv)
    torch_logits = int4_model.model(batch, torch_kv)  # the torch model: no hook inside it any more
    written = batch.slots
    for pool_native, pool_torch in ((native_kv.k, torch_kv.k), (native_kv.v, torch_kv.v)):
        flat_native = pool_native.view(pool_native.shape[0], -1, *pool_native.shape[3:])
        flat_torch = pool_torch.view(pool_torch.shape[0], -1, *pool_torch.shape[3:])
        untouched = torch.ones(flat_native.shape[1], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(flat_native[:, untouched], flat_torch[:, untouched])  # nothing else written
        assert not torch.equal(flat_native[:, written], torch.zeros_like(flat_native[:, written]))
        difference = (flat_native[:, written].float() - flat_torch[:, written].float()).abs().max()
        assert difference < 1.0, difference  # both round the same layer inputs differently, the model's K/V are O(10)
    kl = torch.nn.functional.kl_div(
        native_logits.log_softmax(-1), torch_logits.log_softmax(-1), log_target=True, reduction="none"
    ).sum(-1)
    assert kl.max() < 0.05, kl
    assert (native_logits.argmax(-1) == torch_logits.argmax(-1)).float().mean() >= 0.8


def test_a_prompt_in_one_chunk_gives_what_decoding_it_token_by_token_gives(invariant_model: CpuNativeBackend) -> None:
    model, prompt = invariant_model.forward, [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30]
    chunked = allocate_kv(invariant_model.config, num_pages=2, page_size=PAGE, dtype=torch.bfloat16)
    stepped = allocate_kv(invariant_model.config, num_pages=2, page_size=PAGE, dtype=torch.bfloat16)
    whole = model(make_batch([Chunk(prompt, 0, [0])], PAGE), chunked)
    for position, token in enumerate(prompt):
        last = model(make_batch([Chunk([token], position, [0])], PAGE), stepped)
    assert torch.equal(whole, last)
    assert torch.equal(chunked.k, stepped.k) and torch.equal(chunked.v, stepped.v)


def test_a_prompt_chunk_next_to_decodes_changes_neither(invariant_model: CpuNativeBackend, prefilled) -> None:
    kv, prompts = prefilled
    decodes = _decode_logits(invariant_model, kv, prompts, [0, 1])
    prompt = [1, 9690, 198, 2683, 359]
    alone = invariant_model.forward(make_batch([Chunk(prompt, 0, [19])], PAGE), PagedKV(k=kv.k.clone(), v=kv.v.clone()))
    mixed_batch = make_batch(
        [Chunk([7], len(prompts[0]), [0, 1, 2, 3]), Chunk(prompt, 0, [19]), Chunk([7], len(prompts[1]), [4, 5, 6, 7])],
        PAGE,
    )
    mixed = invariant_model.forward(mixed_batch, PagedKV(k=kv.k.clone(), v=kv.v.clone()))
    assert torch.equal(mixed[0], decodes[0]) and torch.equal(mixed[2], decodes[1]) and torch.equal(mixed[1], alone[0])


def test_steps_of_max_rows_tokens_or_more_run_on_the_torch_path_of_the_same_backend(
    int4_model: CpuNativeBackend, prefilled
) -> None:
    kv, _ = prefilled
    native = int4_model.native
    saved, native.max_rows = native.max_rows, 8
    try:
        assert native.takes(make_batch([Chunk(list(range(7)), 0, [19])], PAGE), kv)
        assert not native.takes(make_batch([Chunk(list(range(8)), 0, [19])], PAGE), kv)
        native_steps, torch_steps = int4_model.served["native"], int4_model.served["torch"]
        int4_model.forward(make_batch([Chunk(list(range(8)), 0, [19])], PAGE), PagedKV(k=kv.k.clone(), v=kv.v.clone()))
        assert int4_model.served["torch"] == torch_steps + 1 and int4_model.served["native"] == native_steps
    finally:
        native.max_rows = saved
    assert not native.takes(make_batch([Chunk([5], 3, [19])], PAGE), PagedKV(k=kv.k.float(), v=kv.v.float()))
