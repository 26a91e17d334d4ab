"""One batched sampling pipeline: logit bias → penalties → grammar mask → thinking budget → temperature → top-k/top-p/min-p → draw.

Each row's result depends only on its own logits and its own state: a seeded request draws from
its own torch.Generator, so it samples the same tokens alone or in any batch. Temperature 0 is
argmax. A row with a grammar (worker/grammar.py) has the tokens its grammar forbids set to -inf
before temperature and the filters, so the filters renormalize among allowed tokens; greedy rows
are masked too. A row whose thinking budget is spent (worker/reasoning_budget.py) then has one
token left, the next of the block's closing tag. Rows without a grammar, budget, bias, penalties or
logprobs cost nothing extra.

Logprobs, for the rows that ask, describe the distribution the token was actually drawn from:

- temperature > 0: log-softmax of the adjusted logits (after bias, penalties and the grammar mask)
  divided by the temperature, restricted to the top-k / top-p / min-p candidates and renormalized
  over them. Tokens outside have probability 0 (-inf) and are never listed as alternatives.
- temperature 0 (greedy): log-softmax of the adjusted logits at temperature 1, over the whole
  vocabulary (minus what the grammar forbids); the chosen token is the first alternative.

`top` lists up to `logprobs` alternatives, best first, the chosen token among them when it is one
of the best. Each row's figures are computed on its own slice, so they do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol import SamplingParams
from worker.grammar import GrammarMatcher, apply_token_masks
from worker.reasoning_budget import ThinkingBudget


@dataclass
class TokenLogprob:
    """A sampled token's log-probability and the best alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]  # per row; None where the row did not ask


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
        grammar: GrammarMatcher | None = None,
        logprobs: int | None = None,
        budget: ThinkingBudget | None = None,
    ) -> None:
        self.params = params
        self.grammar = grammar
        self.budget = budget  # a thinking budget: forces the block's close once spent
        self.logprobs = logprobs  # how many alternatives to report; None: no logprobs
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
        self.plain_argmax = (
            self.greedy and not self.adjusts_logits and grammar is None and logprobs is None and budget is None
        )

    def record(self, token_id: int) -> None:
        """Count a newly sampled token for the penalties; advance the grammar over it."""
        if self.grammar is not None:
            self.grammar.consume(token_id)
        if self.budget is not None:
            self.budget.record(token_id)
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


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [S] (int64), the first index of the row's maximum (or of its first NaN) as torch's.

    On the CPU through numpy: its float32 argmax is vectorized, torch's is not; 16 rows of a 151,936-token
    vocabulary took 2.0 ms with torch and 0.15 with numpy here (docs/benchmarks.md, "The engine around the
    native step at 16 streams"), the same indices, ties and NaNs included (tests/worker/test_sampler.py).
    """
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return torch.from_numpy(logits.numpy().argmax(axis=-1))


def sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> Sampled:
    """One token per row of logits [S, V] (float32, modified in place), row i following states[i]."""
    if all(state.plain_argmax for state in states):
        return Sampled(greedy_tokens(logits).tolist(), [None] * len(states))
    for row, state in enumerate(states):
        if state.adjusts_logits:
            state.adjust(logits[row])
    constrained = [row for row, state in enumerate(states) if state.grammar is not None]
    if constrained:
        apply_token_masks(logits, constrained, [states[row].grammar for row in constrained])
    for row, state in enumerate(states):
        forced = state.budget.forced() if state.budget is not None else None
        if forced is not None:  # the thinking budget is spent: its close is the only token left
            logits[row].fill_(float("-inf"))
            logits[row, forced] = 0.0
    tokens = greedy_tokens(logits)
    reports = _Reports()
    for row, state in enumerate(states):
        if state.greedy and state.logprobs is not None:
            row_logprobs = logits[row].log_softmax(dim=-1)
            best = row_logprobs.topk(min(state.logprobs, row_logprobs.shape[-1]))
            reports.add(row, row_logprobs[tokens[row]], best.indices, best.values)
    random_rows = [row for row, state in enumerate(states) if not state.greedy]
    if random_rows:
        draw = _draw(logits[random_rows], [states[row] for row in random_rows])
        tokens[random_rows] = draw.tokens
        for index, row in enumerate(random_rows):
            wanted = states[row].logprobs
            if wanted is not None:  # on the row's own candidates: the same figures alone or in a batch
                width = draw.widths[index]
                row_logprobs = draw.candidates[index, :width].log_softmax(dim=-1)
                count = min(wanted, width)
                reports.add(row, row_logprobs[draw.choice[index]], draw.order[index, :count], row_logprobs[:count])
    token_list = tokens.tolist()
    return Sampled(token_list, reports.collect(token_list, len(states)))


class _Reports:
    """Logprob tensors of the rows that asked, read back to the host in one transfer each."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []  # (row, number of alternatives)
        self.values: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []

    def add(self, row: int, chosen: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor) -> None:
        self.rows.append((row, top_ids.numel()))
        self.values += [chosen.reshape(1), top_values]
        self.ids.append(top_ids)

    def collect(self, tokens: list[int], num_rows: int) -> list[TokenLogprob | None]:
        result: list[TokenLogprob | None] = [None] * num_rows
        if not self.rows:
            return result
        values = torch.cat(self.values).tolist()
        ids = torch.cat(self.ids).tolist()
        at_value = at_id = 0
        for row, count in self.rows:
            chosen, top_values = values[at_value], values[at_value + 1 : at_value + 1 + count]
            top = [(i, v) for i, v in zip(ids[at_id : at_id + count], top_values) if v != float("-inf")]
            result[row] = TokenLogprob(tokens[row], chosen, top)
            at_value, at_id = at_value + 1 + count, at_id + count
        return result


@dataclass
class _Draw:
    tokens: torch.Tensor  # [R] token ids
    candidates: torch.Tensor  # [R, C] scaled logits, best first, -inf outside each row's filters
    order: torch.Tensor  # [R, C] the candidates' token ids
    choice: torch.Tensor  # [R] the chosen candidate's index
    widths: list[int]  # each row's own number of candidates (its top-k, or the vocabulary)


def _draw(logits: torch.Tensor, states: list[SamplingState]) -> _Draw:
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
    candidates = _filter(candidates, params, widths)
    probs = candidates.softmax(dim=-1)
    # Exponential race (Gumbel-max): argmax(p / Exp(1)) is a draw from p. A seeded row draws its
    # noise for its own candidates from its own generator, so its tokens do not depend on the batch.
    noise = torch.empty_like(probs).exponential_()
    for row, state in enumerate(states):
        if state.generator is not None:
            noise[row, : widths[row]].exponential_(generator=state.generator)
    choice = (probs / noise).argmax(dim=-1)
    return _Draw(order.gather(-1, choice[:, None]).squeeze(-1), candidates, order, choice, widths)


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
