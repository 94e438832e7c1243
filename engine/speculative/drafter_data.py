"""Training data for a drafter: token sequences with the frozen target's hidden states (the layers
the drafter reads) and its next-token distributions (top-k) at every position.

Two sources: `self` — the target's own outputs on built-in prompts (self-distillation: the first
pass over the prompts greedy, later passes sampled), generated in batches while the hidden states
and distributions are captured on the way; or a text file — cut into windows the target scores.
`starts[i]` is the first position of sequence i that the drafter sees as context (where drafting
begins: after the prompt); earlier positions are neither attended to nor trained on.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from engine.errors import BonsaiError
from engine.runtime.kv_cache import CacheBatch, KVCache

TRAIN_PROMPTS = [
    "Explain how a hash map works.", "Write a short poem about the sea.", "What causes the seasons on Earth?",
    "Give me three tips for learning a new language.", "Write a Python function that reverses a string.",
    "Summarize the plot of Romeo and Juliet.", "What is the difference between weather and climate?",
    "How do vaccines work?", "Describe a typical day of a baker.", "Write a haiku about autumn leaves.",
    "Explain recursion to a child.", "What are the benefits of regular exercise?",
    "Write a SQL query that counts the rows of a table named users.", "Why is the sky blue?",
    "List five fruits and their colors.", "How does a bicycle stay upright?", "Write a short story about a lost cat.",
    "What is photosynthesis?", "Explain the rules of chess briefly.", "How do I make a cup of tea?",
    "Write a JavaScript function that adds two numbers.", "What is machine learning?",
    "Describe the water cycle.", "Give advice to someone starting their first job.",
    "Explain what an operating system does.", "Write a thank-you note to a teacher.",
    "What are prime numbers? Give examples.", "How do airplanes fly?", "Write a limerick about a frog.",
    "What is the capital of France and what is it known for?", "Explain how the internet works.",
    "Write a recipe for pancakes.",
]
EVAL_PROMPTS = [
    "Explain how a refrigerator keeps food cold.", "Write a short poem about mountains.",
    "What is the difference between a list and a tuple in Python?", "Give me three tips for sleeping better.",
    "Describe how a rainbow forms.", "Write a Python function that checks whether a number is even.",
    "What are the main causes of traffic jams?", "Summarize the story of Cinderella.",
]


@dataclass
class DrafterData:
    tokens: torch.Tensor  # [N, T] token ids (padding after lengths[i])
    lengths: torch.Tensor  # [N] valid tokens per sequence
    starts: torch.Tensor  # [N] first position the drafter sees
    hidden: dict[int, torch.Tensor]  # target layer → [N, T, H] float32
    top_ids: torch.Tensor  # [N, T, K] the target's top-k next tokens after each position
    top_probs: torch.Tensor  # [N, T, K] their probabilities
    eval_prompts: list[list[int]]  # held-out prompts for the acceptance figure

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    def vocab_rows(self) -> torch.Tensor:
        """Every token id the data can ask for (the target's top-k and the tokens themselves)."""
        return torch.unique(torch.cat([self.top_ids.flatten(), self.tokens.flatten()]))

    def save(self, path: Path) -> None:
        from engine.speculative.drafter_file import atomic_write
        state = {"tokens": self.tokens, "lengths": self.lengths, "starts": self.starts, "top_ids": self.top_ids,
                 "top_probs": self.top_probs, "eval_prompts": self.eval_prompts,
                 "hidden": {str(k): v for k, v in self.hidden.items()}}
        atomic_write(Path(path), lambda tmp: torch.save(state, tmp))

    @staticmethod
    def load(path: Path) -> "DrafterData":
        state = torch.load(path, weights_only=True)
        state["hidden"] = {int(k): v for k, v in state["hidden"].items()}
        return DrafterData(**state)


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A built-in prompt as the model sees a user turn (its chat template when it has one)."""
    if tokenizer.chat_template:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    return tokenizer.encode(text, add_special_tokens=True)


class _Recorder:
    """Fills the data tensors row by row from forward passes."""

    def __init__(self, n: int, length: int, hidden_size: int, layers: tuple[int, ...], top_k: int):
        self.tokens = torch.zeros(n, length, dtype=torch.long)
        self.hidden = {i: torch.zeros(n, length, hidden_size) for i in layers}
        self.top_ids = torch.zeros(n, length, top_k, dtype=torch.long)
        self.top_probs = torch.zeros(n, length, top_k)
        self.top_k = top_k

    def put(self, row: int, start: int, tokens: list[int], logits: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        """tokens fed at positions start.., their logits [t, V] and hidden {layer: [t, H]}."""
        t = len(tokens)
        self.tokens[row, start:start + t] = torch.tensor(tokens)
        probs = torch.softmax(logits.float(), dim=-1)  # [t, V]
        top = torch.topk(probs, self.top_k, dim=-1)
        self.top_ids[row, start:start + t] = top.indices.cpu()
        self.top_probs[row, start:start + t] = top.values.cpu()
        for i, h in hidden.items():
            self.hidden[i][row, start:start + t] = h.float().cpu()

    def copy_prefix(self, source: int, row: int, n: int) -> None:
        for table in (self.tokens, self.top_ids, self.top_probs, *self.hidden.values()):
            table[row, :n] = table[source, :n]


def _shared_prefix(prompts: list[list[int]]) -> int:
    """Leading tokens all prompts share, leaving each at least one of its own."""
    n = min(len(p) for p in prompts) - 1
    for i in range(max(n, 0)):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return max(n, 0)


def _choose(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def _generate_rows(loaded, prompts: list[list[int]], length: int, layers: tuple[int, ...], rec: _Recorder,
                   first_row: int, temperatures: list[float], generator: torch.Generator, stop_ids: frozenset[int],
                   share_prefix: bool = True) -> list[int]:
    """Continue `prompts` together up to `length` tokens each (or a stop token), row r sampled at
    temperatures[r] (0: greedy); returns the lengths."""
    model, device, b = loaded.model, loaded.device, len(prompts)
    cache = KVCache(loaded.config, length, b, dtype=loaded.dtype, device=device)
    common = _shared_prefix(prompts) if share_prefix else 0  # a chat template's system prompt: run once, copied to every row
    if common:
        batch = CacheBatch.make([0], [0], common, device)
        logits, hidden = model.forward_hidden(torch.tensor([prompts[0][:common]], device=device), batch, cache,
                                              common, None, layers)  # [1, C, V]
        rec.put(first_row, 0, prompts[0][:common], logits[0], {i: h[0] for i, h in hidden.items()})
        for r in range(1, b):
            rec.copy_prefix(first_row, first_row + r, common)
            cache.k[:, r, :, :common] = cache.k[:, 0, :, :common]
            cache.v[:, r, :, :common] = cache.v[:, 0, :, :common]
    fed, nxt = [], []
    for r, prompt in enumerate(prompts):
        rest = prompt[common:]
        batch = CacheBatch.make([r], [common], len(rest), device)
        ids = torch.tensor([rest], device=device)  # [1, P - C]
        logits, hidden = model.forward_hidden(ids, batch, cache, len(prompt), None, layers)  # [1, P - C, V]
        rec.put(first_row + r, common, rest, logits[0], {i: h[0] for i, h in hidden.items()})
        fed.append(len(prompt))
        nxt.append(_choose(logits[0, -1], temperatures[r], generator))
    active = [f < length for f in fed]
    while any(active):
        rows = [r for r in range(b) if active[r]]
        batch = CacheBatch.make(rows, [fed[r] for r in rows], 1, device)
        ids = torch.tensor([[nxt[r]] for r in rows], device=device)  # [B, 1]
        logits, hidden = model.forward_hidden(ids, batch, cache, max(fed[r] for r in rows) + 1, None, layers)
        for i, r in enumerate(rows):
            rec.put(first_row + r, fed[r], [nxt[r]], logits[i], {j: h[i] for j, h in hidden.items()})
            fed[r] += 1
            if nxt[r] in stop_ids or fed[r] >= length:
                active[r] = False
            else:
                nxt[r] = _choose(logits[i, -1], temperatures[r], generator)
    return fed


def self_distillation_data(loaded, layers: tuple[int, ...], samples: int, seq_len: int, batch: int = 16,
                           top_k: int = 16, temperature: float = 0.8, seed: int = 0, eval_prompts: int = 8,
                           on_progress: Callable[[int, int], None] | None = None) -> DrafterData:
    """`samples` sequences of the target's own continuations of the built-in prompts, each
    `seq_len` tokens long (prompt included) or ending at a stop token: greedy on the first pass
    over the prompts, sampled at `temperature` on later passes."""
    tokenizer = loaded.require_tokenizer()
    prompts = [prompt_ids(tokenizer, p) for p in TRAIN_PROMPTS]
    longest = max(len(p) for p in prompts + [prompt_ids(tokenizer, p) for p in EVAL_PROMPTS])
    if seq_len < longest + 16:
        raise BonsaiError(f"--seq-len {seq_len} leaves too little room after the built-in prompts ({longest} "
                          f"tokens with this model's chat template): use at least {longest + 16}")
    rec = _Recorder(samples, seq_len, loaded.config.hidden_size, layers, top_k)
    generator = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    chosen = [prompts[i % len(prompts)] for i in range(samples)]
    for first in range(0, samples, batch):
        part = chosen[first:first + batch]
        temperatures = [0.0 if first + r < len(prompts) else temperature for r in range(len(part))]
        lengths += _generate_rows(loaded, part, seq_len, layers, rec, first, temperatures, generator,
                                  tokenizer.eos_ids)
        if on_progress:
            on_progress(min(first + batch, samples), samples)
    evals = [prompt_ids(tokenizer, p) for p in EVAL_PROMPTS[:eval_prompts]]
    return DrafterData(rec.tokens, torch.tensor(lengths), torch.tensor([len(p) for p in chosen]), rec.hidden,
                       rec.top_ids, rec.top_probs, evals)


@torch.inference_mode()
def score_sequences(loaded, sequences: list[list[int]], starts: list[int], layers: tuple[int, ...],
                    eval_prompts: list[list[int]], top_k: int = 16,
                    on_progress: Callable[[int, int], None] | None = None) -> DrafterData:
    """Data from given token sequences of equal length, scored by the target in batches."""
    seq_len = len(sequences[0])
    assert all(len(s) == seq_len for s in sequences)
    batch = max(1, min(16, 2 ** 26 // (seq_len * loaded.config.vocab_size)))  # logits of a batch ≤ 256 MB
    rec = _Recorder(len(sequences), seq_len, loaded.config.hidden_size, layers, top_k)
    device = loaded.device
    for first in range(0, len(sequences), batch):
        part = sequences[first:first + batch]
        cache = KVCache(loaded.config, seq_len, len(part), dtype=loaded.dtype, device=device)
        cache_batch = CacheBatch.make(list(range(len(part))), [0] * len(part), seq_len, device)
        logits, hidden = loaded.model.forward_hidden(torch.tensor(part, device=device), cache_batch, cache,
                                                     seq_len, None, layers)  # [B, T, V]
        for r, window in enumerate(part):
            rec.put(first + r, 0, window, logits[r], {i: h[r] for i, h in hidden.items()})
        if on_progress:
            on_progress(min(first + batch, len(sequences)), len(sequences))
    return DrafterData(rec.tokens, torch.full((len(sequences),), seq_len), torch.tensor(starts), rec.hidden,
                       rec.top_ids, rec.top_probs, eval_prompts)


def text_file_data(loaded, path: Path, layers: tuple[int, ...], seq_len: int, top_k: int = 16, seed: int = 0,
                   eval_prompts: int = 8, max_sequences: int | None = None,
                   on_progress: Callable[[int, int], None] | None = None) -> DrafterData:
    """Windows of seq_len tokens of a UTF-8 text file scored by the target; the last `eval_prompts`
    windows are held out, their first half serving as prompts for the acceptance figure. Drafting
    is taken to begin at a random point of each window's first half."""
    path = Path(path)
    if not path.is_file():
        raise BonsaiError(f"training text not found: {path} (give a UTF-8 text file, or --data self)")
    ids = loaded.require_tokenizer().encode(path.read_text(encoding="utf-8", errors="replace"))
    windows = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    if len(windows) < eval_prompts + 1:
        raise BonsaiError(f"{path} holds {len(ids)} tokens: too little for {eval_prompts + 1} windows of "
                          f"{seq_len} tokens; give more text or lower --seq-len")
    held_out, windows = windows[-eval_prompts:], windows[:-eval_prompts]
    windows = windows[:max_sequences] if max_sequences else windows
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, seq_len // 2, (len(windows),), generator=generator).tolist()
    return score_sequences(loaded, windows, starts, layers, [w[:seq_len // 2] for w in held_out], top_k,
                           on_progress)
