"""Continuous batching: which sequences run in the next step.

A step is either a prefill of newly admitted sequences (as many as the KV
cache and the token budget allow) or one decode token for every running
sequence. Sequences finish after ``max_tokens`` generated tokens.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from .kv_cache import BlockManager

_ids = itertools.count()


@dataclass
class Sequence:
    token_ids: list[int]
    max_tokens: int
    num_prompt: int = 0
    num_cached: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    seq_id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        self.num_prompt = self.num_prompt or len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def finished(self) -> bool:
        return len(self.output_ids) >= self.max_tokens


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int):
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill."""
        batch, budget = [], self.max_batch_tokens
        while self.waiting:
            seq = self.waiting[0]
            if batch and len(seq) > budget or not self.blocks.can_allocate(len(seq)):
                break
            self.waiting.popleft()
            self.blocks.grow(seq.block_table, len(seq))
            self.running.append(seq)
            batch.append(seq)
            budget -= len(seq)
        if batch:
            return batch, True
        for seq in list(self.running):
            if seq not in self.running:  # preempted below for an earlier sequence
                continue
            while self.blocks.blocks_for(len(seq)) > len(seq.block_table) and not self.blocks.free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.blocks.grow(seq.block_table, len(seq))
        return list(self.running), False

    def preempt_all(self) -> None:
        """Give every running sequence's blocks back; each is recomputed from its tokens later
        (after a rebuild the KV cache of the group cannot be trusted)."""
        for seq in reversed(list(self.running)):
            self._preempt(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every sequence, running or waiting (their requests are answered with an error)."""
        self.preempt_all()
        dropped = list(self.waiting)
        self.waiting.clear()
        return dropped

    def _preempt(self, seq: Sequence) -> None:
        """Free a sequence's blocks; it is recomputed from scratch later."""
        self.running.remove(seq)
        self.blocks.release(seq.block_table)
        seq.num_cached = 0
        self.waiting.appendleft(seq)

    def finish_step(self, seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Append each sequence's new token; return those that finished."""
        done = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.num_cached = len(seq)
            seq.token_ids.append(token)
            if seq.finished:
                self.running.remove(seq)
                self.blocks.release(seq.block_table)
                done.append(seq)
        return done
