"""The engine benchmark's peer: Hugging Face transformers' `generate` on the same GGUF weights, in this process.

transformers dequantizes the GGUF to float32 (its only way to run it) and needs `gguf` and `accelerate`
(the `bench` extra). Nothing is downloaded: local files only.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from bench.engine.speed_report import Figures, Sizes


def load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def version() -> str:
    import transformers

    return transformers.__version__


def _token_clock():
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        """Stamps every `put`: the prompt first, then each step's new tokens (all rows at once)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return TokenClock()


def generate_times(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[float]:
    """Greedy generation of exactly `new_tokens` per row (equal-length prompts, no padding): the start, then each step's end."""
    ids = torch.tensor(prompts)
    clock = _token_clock()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
        )
    return clock.times


def decode_rate(times: list[float], rows: int) -> float:
    """Tokens/s of the decode steps only: from the first generated token to the last."""
    return rows * (len(times) - 2) / (times[-1] - times[1])


def measure(path: Path, sizes: Sizes, decode_prompts: list[list[int]], prefill_prompts: list[list[int]]) -> Figures:
    """decode_prompts[0] is the single stream; all `sizes.batch` of them form the batch; prefill: the median."""
    model = load(path)
    generate_times(model, prefill_prompts[:1], 4)  # warm-up
    single = generate_times(model, decode_prompts[:1], sizes.decode_tokens)
    batch = generate_times(model, decode_prompts[: sizes.batch], sizes.decode_tokens)
    prefills = [generate_times(model, [prompt], 1) for prompt in prefill_prompts]
    return Figures(
        decode_1=decode_rate(single, 1),
        decode_batch=decode_rate(batch, sizes.batch),
        prefill=sizes.prefill / statistics.median(times[1] - times[0] for times in prefills),
    )
