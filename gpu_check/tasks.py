"""The fixed data of the experiment (CONTRACT section 7): arithmetic, chosen up front.

Four supervised samples train the one update; eight other questions are asked once at
version 0 for the frozen rollouts (never trained on); one fixed prompt is generated
before and after the update. Rewards are exact-match, computed after the rollouts were
chosen (the first response per question, whatever its reward).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs

REWARD_FUNCTION = "arithmetic_exact_match"
REWARD_VERSION = "1"


@attrs.frozen
class Question:
    """One arithmetic question and its answer."""

    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        """The exact result."""
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    @property
    def expression(self) -> str:
        """`a op b`, no spaces."""
        return f"{self.a}{self.op}{self.b}"


SUPERVISED = (Question(3, "+", 4), Question(12, "+", 7), Question(5, "*", 6), Question(9, "-", 2))
FROZEN = (
    Question(2, "+", 2),
    Question(8, "+", 5),
    Question(6, "*", 3),
    Question(15, "-", 6),
    Question(4, "*", 4),
    Question(10, "+", 11),
    Question(7, "-", 3),
    Question(9, "*", 2),
)
FIXED_PROMPT = Question(1, "+", 1)


def prompt_text(tokenizer: Any, q: Question) -> str:
    """The prompt: the model's chat template when it has one, else `a+b=`."""
    if getattr(tokenizer, "chat_template", None):
        messages = [
            {"role": "user", "content": f"What is {q.expression}? Answer with the number only."}
        ]
        return str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
    return f"{q.expression}="


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as the model sees it (no extra special tokens)."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def prompt_ids(tokenizer: Any, q: Question) -> list[int]:
    """Token ids of the prompt."""
    ids = encode(tokenizer, prompt_text(tokenizer, q))
    if not ids:
        raise ValueError(f"the tokenizer encodes the prompt for {q.expression} to no tokens")
    return ids


def supervised_response_ids(tokenizer: Any, q: Question) -> list[int]:
    """The target response: the answer, then EOS (EOS is a trained, scored token)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; the check needs an end-of-sequence")
    return [*encode(tokenizer, str(q.answer)), int(eos)]


_INT = re.compile(r"-?\d+")


def reward(text: str, q: Question) -> float:
    """1.0 when the first integer in the response is the answer, else 0.0."""
    m = _INT.search(text)
    return 1.0 if m is not None and int(m.group()) == q.answer else 0.0


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of response tokens, special tokens dropped."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=True))
