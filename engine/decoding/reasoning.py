"""Splitting a model's output into reasoning and answer on the chat template's think tags.

Pure text bookkeeping, tested without a model. The splitter is told whether the prompt already
opened a thought (templates such as Qwen3's end the generation prompt with ``<think>``); otherwise
a thought counts only if the output starts with the start tag. Text that could be the start of a
tag is held back until it is known not to be one; the tags themselves never reach the client.
"""
from __future__ import annotations

from enum import Enum


class Phase(Enum):
    START = "start"  # nothing decided yet: the output may open with the start tag
    THINKING = "thinking"
    ANSWER = "answer"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, start_tag: str, end_tag: str, thinking: bool = False, enabled: bool = True):
        """enabled=False: every piece is answer text (raw completions)."""
        self.start_tag, self.end_tag = start_tag, end_tag
        self.phase = Phase.THINKING if thinking else Phase.START if enabled else Phase.ANSWER
        self.thought = thinking  # whether a thought was opened at all
        self.answer_chars = 0  # answer text released so far (stripped of the whitespace after the thought)
        self.reasoning_chars = 0
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """Feed output text; returns (reasoning piece, answer piece) safe to release."""
        reasoning, answer = "", ""
        text = self._held + text
        self._held = ""
        while text:
            if self.phase is Phase.START:
                stripped = text.lstrip()
                if stripped.startswith(self.start_tag):
                    self.phase, self.thought = Phase.THINKING, True
                    text = stripped[len(self.start_tag):]
                    continue
                if self.start_tag.startswith(stripped):  # maybe the tag, not complete yet
                    self._held = text
                    break
                self.phase = Phase.ANSWER
            if self.phase is Phase.THINKING:
                if not self.reasoning_chars and not reasoning:
                    text = text.lstrip()  # the line break after the start tag
                cut = text.find(self.end_tag)
                if cut >= 0:
                    reasoning += text[:cut]
                    self.phase = Phase.ANSWER
                    text = text[cut + len(self.end_tag):]
                    continue
                keep = _partial_suffix(text, self.end_tag)
                reasoning += text[:len(text) - keep]
                self._held = text[len(text) - keep:]
                break
            if self.answer_chars == 0 and self.thought:
                text = text.lstrip()  # the blank lines between the thought and the answer
            answer += text
            self.answer_chars += len(text)
            break
        self.reasoning_chars += len(reasoning)
        return reasoning, answer

    def flush(self) -> tuple[str, str]:
        """The end of the output: text held back goes where the phase says."""
        held, self._held = self._held, ""
        if self.phase is Phase.THINKING:
            return held, ""
        if self.answer_chars == 0 and self.thought:
            held = held.lstrip()
        self.answer_chars += len(held)
        return "", held

    @property
    def thinking(self) -> bool:
        return self.phase is Phase.THINKING
