"""Distinct short questions sized in tokens by the target server itself, and long system prefixes.

Sizes are measured, not guessed: `probe(messages)` asks the target for usage.prompt_tokens (chat
template included), and each prompt's filler is lengthened or shortened until it falls in range.
A probe must not send the measured prompt itself: the target would cache it, and the benchmark's
first token would then be a prefix-cache hit. `cache_safe` measures a user turn behind a stand-in
system message instead (a different prefix from the first token on) and corrects for the stand-in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Messages = list[dict[str, str]]
Probe = Callable[[Messages], Awaitable[int]]

TOPICS = [
    "the water cycle", "photosynthesis", "black holes", "the Roman Empire", "volcanoes", "honey bees",
    "the printing press", "ocean tides", "the immune system", "steam engines", "coral reefs",
    "the speed of light", "glaciers", "the Silk Road", "electric motors", "rainbows", "earthquakes",
    "the human heart", "bread baking", "migrating birds", "the moon landing", "desert plants",
    "compound interest", "the periodic table", "wind turbines", "ancient Egypt", "snowflakes",
    "the internet", "jazz music", "rain forests", "the telescope", "chess openings", "vaccines",
    "plate tectonics", "paper making", "lightning", "the Great Wall", "solar panels", "octopuses",
    "the stock market",
]  # fmt: skip
ASKS = [
    "Explain", "Describe", "Give a short overview of", "What should a student know about",
    "Write a brief note on", "Summarize the key ideas behind", "Tell me something surprising about",
    "How would you teach", "List the main facts about", "Why do people find it useful to learn about",
]  # fmt: skip
AUDIENCES = [
    "for a curious child", "for a busy adult", "for a high school class", "in plain words",
    "for a museum guide", "for a podcast listener", "for a beginner", "for a travel blog",
]  # fmt: skip
FILLER = (
    "Please keep the answer clear and friendly, start with the single most important point, then add "
    "a concrete everyday example, mention one common misunderstanding and why it is wrong, and end "
    "with a short practical tip that the reader could try at home or share with a friend later today "
    "without any special tools or preparation at all, while avoiding jargon, long lists and numbers "
    "that are hard to remember."
).split()
SYSTEM_TEXT = (
    "You are a careful assistant for a public library. You answer questions from visitors of every age "
    "with patience and accuracy. You prefer short sentences, everyday words and concrete examples. When "
    "a question is unclear you say what you assumed. You never invent sources, dates or quotations, and "
    "you say so plainly when you do not know something. You keep a warm and respectful tone, you avoid "
    "slang, and you do not give medical, legal or financial advice beyond general information. "
).split()


STAND_IN_SYSTEM = {"role": "system", "content": "Measuring."}
CALIBRATION = [{"role": "user", "content": "A calibration sentence that no workload sends."}]


async def cache_safe(probe: Probe) -> Probe:
    """A probe of user-only message lists that never sends them as they are (see the module's notes)."""
    offset = await probe(CALIBRATION) - await probe([STAND_IN_SYSTEM, *CALIBRATION])

    async def measure(messages: Messages) -> int:
        return await probe([STAND_IN_SYSTEM, *messages]) + offset

    return measure


def question(index: int) -> str:
    """The index-th distinct question (a mixed-radix walk over topics, asks and audiences)."""
    topic = TOPICS[index % len(TOPICS)]
    ask = ASKS[(index // len(TOPICS)) % len(ASKS)]
    audience = AUDIENCES[(index // (len(TOPICS) * len(ASKS))) % len(AUDIENCES)]
    return f"{ask} {topic} {audience}."


def max_distinct_questions() -> int:
    return len(TOPICS) * len(ASKS) * len(AUDIENCES)


def user_text(index: int, filler_words: int) -> str:
    return " ".join([question(index), *FILLER[:filler_words]])


def system_text(words: int, nonce: int | None = None) -> str:
    """A long system prompt; a nonce at its start makes it share no prefix with any other."""
    repeated = (SYSTEM_TEXT * (words // len(SYSTEM_TEXT) + 1))[:words]
    head = [f"Ticket {nonce:06d}."] if nonce is not None else []
    return " ".join(head + repeated)


async def fit_user_prompt(index: int, probe: Probe, low: int, high: int, tries: int = 6) -> tuple[str, int]:
    """A prompt for question `index` whose templated length is within [low, high] tokens."""
    target = (low + high) // 2
    words = len(FILLER) // 2
    for _ in range(tries):
        text = user_text(index, words)
        tokens = await probe([{"role": "user", "content": text}])
        if low <= tokens <= high:
            return text, tokens
        step = target - tokens  # about one token per filler word
        words = max(0, min(len(FILLER), words + step))
    raise ValueError(f"could not fit question {index} into {low}-{high} prompt tokens (last: {tokens})")


async def fit_user_prompts(count: int, first: int, probe: Probe, low: int, high: int, parallel: int = 4) -> list[str]:
    """`count` distinct prompts, questions first .. first+count-1, each within [low, high] tokens."""
    if first + count > max_distinct_questions():
        raise ValueError(f"only {max_distinct_questions()} distinct questions exist")
    gate = asyncio.Semaphore(parallel)

    async def fit(index: int) -> str:
        async with gate:
            return (await fit_user_prompt(index, probe, low, high))[0]

    return list(await asyncio.gather(*(fit(first + i) for i in range(count))))


async def fit_system_words(tokens: int, probe: Probe) -> int:
    """Words of SYSTEM_TEXT that make a system message of about `tokens` tokens."""
    user = [{"role": "user", "content": "Hello."}]
    base = await probe([{"role": "system", "content": ""}, *user])
    words = tokens
    for _ in range(4):
        measured = await probe([{"role": "system", "content": system_text(words)}, *user]) - base
        if abs(measured - tokens) <= max(2, tokens // 50):
            break
        words = max(1, round(words * tokens / max(measured, 1)))
    return words
