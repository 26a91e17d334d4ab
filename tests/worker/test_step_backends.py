"""The step backends' contract (worker/runtime/): every backend this machine can run takes the same
random workload through the real scheduler and gives logits for the sampling rows only, within
`KL_TOLERANCE` of the CPU-torch reference, and leaks no page. A backend missing here is skipped,
so the CUDA backend is checked by this same test the day it runs on a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from worker import compute_thread
from worker.model.loader import LoadedModel, load_model
from worker.model.paged_attention import plan_attention
from worker.native import build
from worker.runtime.cpu_torch import CpuTorchBackend
from worker.runtime.cuda import CudaBackend
from worker.runtime.select import select_backend
from worker.scheduler import Scheduler, Sequence

PAGE = 16
SHARED = 5 * PAGE  # a system prompt of 5 full pages: decodes behind it share >= 4 pages (the cascade path)
STEPS = 14
# Mean / worst KL(reference || backend) per sampling row: the native step rounds activations to int16
# where torch keeps bfloat16 (tests/worker/test_native_steps.py), and to int8 in batched decodes (its int8
# tier: this workload's 6-row steps), whose worst row is held to the default mode's own bar against float32
# (test_reference.py's LIMITS: 0.1; measured 0.050 on Intel Xeon, 2026-12-04); a GPU sums in another order.
KL_TOLERANCE = {"cpu-torch": (0.0, 0.0), "cpu-native": (0.01, 0.1), "cuda": (0.01, 0.05)}


def _load(device: str, cpu_steps: str) -> LoadedModel:
    return compute_thread.run(
        load_model,
        None,
        dtype="bfloat16",
        quant="int4" if device == "cpu" else "auto",
        device=device,
        cpu_steps=cpu_steps,
    )


@pytest.fixture(scope="module")
def reference() -> CpuTorchBackend:
    loaded = _load("cpu", "torch")
    return compute_thread.run(select_backend, loaded, max_threads=1)


def _native():
    if not {"avx512_vnni", "avx512bw"} <= build.cpu_flags():
        pytest.skip("no AVX-512 VNNI on this CPU")
    backend = compute_thread.run(select_backend, _load("cpu", "native"), max_threads=1)
    assert backend.name == "cpu-native", "the selector picks the native step where it attached"
    return backend


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    backend = compute_thread.run(select_backend, _load("cuda", "torch"), max_threads=1)
    assert backend.name == "cuda"
    return backend


def _workload(seed: int = 3) -> list[Sequence]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 49_000) for _ in range(SHARED)]
    seqs = []
    for index in range(6):
        tail = [rng.randrange(1, 49_000) for _ in range(rng.randrange(3, 40))]
        prompt = (shared if index % 3 else []) + tail
        seqs.append(Sequence(id=f"s{index}", token_ids=prompt, num_prompt_tokens=len(prompt)))
    return seqs


def _run(backend) -> tuple[list[torch.Tensor], int]:
    """The workload's logits step by step (teacher-forced: the same next tokens for every backend); pages used after."""

    def run() -> tuple[list[torch.Tensor], int]:
        kv = backend.make_kv(96 * backend.kv_page_bytes(PAGE), PAGE, 8)
        backend.prepare(kv, 8)
        scheduler = Scheduler(kv, max_seqs=8, step_tokens=64, max_context=512, batch_tokens_beside_interactive=64)
        seqs, rng, steps = _workload(), random.Random(11), []
        for seq in seqs:
            scheduler.add(seq)
        for _ in range(STEPS):
            plan = scheduler.schedule()
            batch = backend.build_batch(plan.scheduled, PAGE)
            with torch.inference_mode():
                logits = backend.forward(batch, kv.kv).float().cpu()
            samplers = [item for item in plan.scheduled if item.samples]
            assert logits.shape[0] == len(samplers), "logits for the sampling rows only"
            steps.append(logits)
            scheduler.complete(plan)
            for item in samplers:
                item.seq.token_ids.append(rng.randrange(1, 49_000))
        for seq in seqs:
            scheduler.remove(seq)
        return steps, kv.num_used

    return compute_thread.run(run)


@pytest.mark.slow
@pytest.mark.parametrize("make", [None, _native, _cuda], ids=["cpu-torch", "cpu-native", "cuda"])
def test_every_backend_matches_the_cpu_torch_reference_and_leaks_no_page(reference, make) -> None:
    backend = reference if make is None else make()
    want, _ = _run(reference)
    got, used = _run(backend)
    assert used == 0, "every page released"
    assert [g.shape for g in got] == [w.shape for w in want]
    kl = torch.cat([
        torch.nn.functional.kl_div(g.log_softmax(-1), w.log_softmax(-1), log_target=True, reduction="none").sum(-1)
        for g, w in zip(got, want)
    ])  # fmt: skip
    mean_bar, worst_bar = KL_TOLERANCE[backend.name]
    assert float(kl.mean()) <= mean_bar and float(kl.max()) <= worst_bar, (float(kl.mean()), float(kl.max()))


def _shared_decodes(backend, page_size: int = PAGE):
    """Two decodes behind the same 5 full pages, as the backend builds their step."""
    seqs = []
    for index in range(2):
        seq = Sequence(id=f"d{index}", token_ids=list(range(SHARED + 3)), num_prompt_tokens=SHARED + 3)
        seq.pages, seq.num_computed = [0, 1, 2, 3, 4, 5 + index], SHARED + 2
        seqs.append(seq)
    from worker.scheduler import Scheduled

    return backend.build_batch([Scheduled(seq, 1, samples=True) for seq in seqs], page_size)


def test_the_batch_says_which_sampled_rows_end_a_prompt(tiny) -> None:
    """A sampled row that is a prompt's last token, however few rows it came with, ends a prompt (it gives the
    answer's first token, which int8 activations never compute); a decode's row, and a chunk short of its
    prompt's end (it samples nothing), do not."""
    from worker.scheduler import Scheduled

    last_of_prompt = Sequence(id="p", token_ids=list(range(17)), num_prompt_tokens=17)  # 16 cached, 1 to feed
    last_of_prompt.pages, last_of_prompt.num_computed = [0, 1], 16
    decode = Sequence(id="d", token_ids=list(range(20)), num_prompt_tokens=17)  # 3 generated, the last to feed
    decode.pages, decode.num_computed = [2, 3], 19
    chunk = Sequence(id="c", token_ids=list(range(30)), num_prompt_tokens=30)
    chunk.pages = [4, 5]
    backend = CpuTorchBackend(tiny, max_threads=1)
    decodes = backend.build_batch([Scheduled(last_of_prompt, 1, True), Scheduled(decode, 1, True)], PAGE)
    assert decodes.is_decode_only and decodes.prompt_ends == [True, False]
    assert backend.build_batch([Scheduled(chunk, 12, False), Scheduled(decode, 1, True)], PAGE).prompt_ends == [
        False,
        False,
    ]
    assert backend.build_batch([Scheduled(chunk, 30, True)], PAGE).prompt_ends == [True]


def test_only_the_cpu_backends_plan_cascade_attention(tiny) -> None:
    """The cascade path calls aten's CPU-only flash op: a CUDA step (an eager mixed step included) must
    never plan it, whatever its decodes share."""
    cpu = CpuTorchBackend(tiny, max_threads=1)
    cuda = CudaBackend(tiny, graphs=False)
    assert plan_attention(_shared_decodes(cpu), PAGE, torch.device("cpu")).decode.shared_pages == 5
    assert plan_attention(_shared_decodes(cuda), PAGE, torch.device("cpu")).decode.shared_pages == 0


def test_the_engine_runs_its_steps_on_the_backend_it_is_given(tiny) -> None:
    """No device check in the engine: the backend it is handed builds every batch and runs every forward."""
    import asyncio

    from protocol import SamplingParams
    from worker.engine import Engine, GenRequest

    class Counting(CpuTorchBackend):
        name = "counting"
        batch_tokens_beside_interactive = 3
        forwards = 0

        def forward(self, batch, kv):
            Counting.forwards += 1
            return super().forward(batch, kv)

    backend = Counting(tiny, max_threads=1)
    done: list[str] = []
    engine = Engine(
        tiny, on_step=lambda outputs: done.extend(o.id for o in outputs if o.finish_reason), backend=backend
    )
    assert engine.backend is backend and engine.scheduler.batch_tokens_beside_interactive == 3
    engine.add(GenRequest("r", list(range(5, 30)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
    engine.stop()
    asyncio.run(engine.run())
    assert done == ["r"] and Counting.forwards == 4
