"""The paged KV cache: fixed-size blocks, a block table per sequence.

``k[layer]`` and ``v[layer]`` are ``(num_blocks, block_size, kv_heads, head_dim)``.
Token ``p`` of a sequence lives in slot ``table[p // block_size] * block_size
+ p % block_size``. Blocks are handed out by ``BlockManager``; the cache
itself is plain tensors, so a snapshot can store and restore the blocks.
"""

from __future__ import annotations

from collections import deque

import torch

from podsnap.errors import PodsnapError


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype):
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.block_size = block_size
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self.free_blocks)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend ``table`` so it holds ``num_tokens`` tokens."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self.free_blocks):
            raise PodsnapError(f"KV cache is full: {need} more block(s) needed, "
                               f"{len(self.free_blocks)} free; raise kv_cache_tokens")
        table.extend(self.free_blocks.popleft() for _ in range(need))

    def release(self, table: list[int]) -> None:
        self.free_blocks.extend(table)
        table.clear()

    def slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        """Cache slots of token positions ``[start, stop)``."""
        pos = torch.arange(start, stop)
        return torch.tensor(table, dtype=torch.long)[pos // self.block_size] * self.block_size + pos % self.block_size
