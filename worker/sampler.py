"""One batched sampling pipeline: logit bias → penalties → temperature → top-k/top-p/min-p → draw.

Each row's result depends only on its own logits and its own state: a seeded request draws from
its own torch.Generator, so it samples the same tokens alone or in any batch. Temperature 0 is
argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol import SamplingParams


class SamplingState:
    """One sequence's sampling parameters, random generator and the token counts its penalties need."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        prompt_ids: Sequence[int],
        generated_ids: Sequence[int],
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.params = params
        self.greedy = params.temperature == 0
        self.generator: torch.Generator | None = None
        if params.seed is not None and not self.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        biased = {token: value for token, value in params.logit_bias.items() if 0 <= token < vocab_size}
        self.bias_ids = torch.tensor(list(biased), dtype=torch.int64, device=device) if biased else None
        self.bias_values = torch.tensor(list(biased.values()), dtype=torch.float32, device=device) if biased else None
        self.output_counts: torch.Tensor | None = None
        if params.presence_penalty or params.frequency_penalty:
            self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self.output_counts.index_add_(0, _ids(generated_ids, device), torch.ones(len(generated_ids), device=device))
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[_ids([*prompt_ids, *generated_ids], device)] = True
        self.adjusts_logits = self.bias_ids is not None or self.output_counts is not None or self.seen is not None

    def record(self, token_id: int) -> None:
        """Count a newly sampled token for the penalties."""
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True

    def adjust(self, logits: torch.Tensor) -> None:
        """Apply logit bias and penalties to this sequence's row of logits [V], in place."""
        params = self.params
        if self.bias_ids is not None:
            logits.index_add_(0, self.bias_ids, self.bias_values)
        if self.seen is not None:
            penalized = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
            torch.where(self.seen, penalized, logits, out=logits)
        if self.output_counts is not None:
            logits -= self.output_counts * params.frequency_penalty
            logits -= (self.output_counts > 0).float() * params.presence_penalty


def _ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.int64, device=device)


def sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> list[int]:
    """One token per row of logits [S, V] (float32, modified in place), row i following states[i]."""
    if all(state.greedy and not state.adjusts_logits for state in states):
        return logits.argmax(dim=-1).tolist()
    for row, state in enumerate(states):
        if state.adjusts_logits:
            state.adjust(logits[row])
    tokens = logits.argmax(dim=-1)
    random_rows = [row for row, state in enumerate(states) if not state.greedy]
    if random_rows:
        drawn = _draw(logits[random_rows], [states[row] for row in random_rows])
        tokens[random_rows] = drawn
    return tokens.tolist()


def _draw(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Sample among each row's best candidates only: a partial sort of the vocabulary, not a full one."""
    device = logits.device
    params = [state.params for state in states]
    vocab = logits.shape[-1]
    widths = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scaled = logits / temperature[:, None]
    if max(widths) < vocab:
        candidates, order = scaled.topk(max(widths), dim=-1)  # best first
    else:  # some row has no top-k: it needs the whole vocabulary ordered
        candidates, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = _filter(candidates, params, widths).softmax(dim=-1)
    # Exponential race (Gumbel-max): argmax(p / Exp(1)) is a draw from p. A seeded row draws its
    # noise for its own candidates from its own generator, so its tokens do not depend on the batch.
    noise = torch.empty_like(probs).exponential_()
    for row, state in enumerate(states):
        if state.generator is not None:
            noise[row, : widths[row]].exponential_(generator=state.generator)
    choice = (probs / noise).argmax(dim=-1, keepdim=True)
    return order.gather(-1, choice).squeeze(-1)


def _filter(candidates: torch.Tensor, params: list[SamplingParams], widths: list[int]) -> torch.Tensor:
    """Mask candidates (each row sorted, best first) outside its top-k, top-p nucleus and min-p floor."""
    device = candidates.device
    drop = torch.arange(candidates.shape[-1], device=device)[None, :] >= torch.tensor(widths, device=device)[:, None]
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        probs = candidates.masked_fill(drop, float("-inf")).softmax(dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]  # the first token always stays
    if any(p.min_p > 0 for p in params):
        # p < min_p * p_max  <=>  logit < best logit + log(min_p): no normalization needed.
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        drop |= candidates < candidates[:, :1] + min_p.log()[:, None]
    return candidates.masked_fill(drop, float("-inf"))
