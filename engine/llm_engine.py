"""The engine of one rank: cold start (load + post-process) and greedy generation.

A cold start reads this rank's shard of the HF checkpoint, post-processes it
on the platform and allocates the paged KV cache; ``timings`` records each
phase. ``generate`` runs continuous batching until every prompt has its
tokens. ``state()`` returns the engine state contract snapshots are made of.

With several ranks, rank 0 (the leader) schedules and broadcasts each step;
the other ranks (followers) sit in ``follow()`` and run what they are sent.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from podsnap.errors import ConfigError, PodsnapError
from podsnap.state import EngineState, Role, StateTensor, TensorMeta

from . import tp
from .checkpoint import CheckpointReader
from .config import ModelConfig
from .kv_cache import BlockManager, KVCache
from .loader import load_checkpoint
from .model import CausalLM, StepContext
from .platform import CpuPlatform, get_platform
from .scheduler import Scheduler, Sequence
from .sharding import ShardPlan

QUANT_MODES = ("none", "w8a8")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineOptions:
    quant: str = "none"
    dtype: str = "float32"
    platform: str = "cpu"
    block_size: int = 16
    kv_cache_tokens: int = 8192
    max_batch_tokens: int = 4096
    compile: bool = False  # torch.compile the dense FFN blocks (engine/compile.py)

    def __post_init__(self):
        if self.quant not in QUANT_MODES:
            raise ConfigError(f"quant {self.quant!r} is not supported; choose one of {', '.join(QUANT_MODES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        if self.block_size < 1 or self.kv_cache_tokens < self.block_size:
            raise ConfigError(f"kv_cache_tokens={self.kv_cache_tokens} must hold at least one "
                              f"block of block_size={self.block_size} tokens")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Timings:
    load: float = 0.0  # read the checkpoint into the model
    postprocess: float = 0.0  # quantize, re-lay-out, build tables
    first_token: float = 0.0  # the first prefill step
    total: float = 0.0  # from cold start to the last generated token
    decode: float = 0.0  # time in decode steps
    decode_tokens: int = 0  # tokens those steps produced
    started: float = field(default_factory=time.perf_counter, repr=False)

    def to_dict(self) -> dict[str, float]:
        out = {k: round(getattr(self, k), 6) for k in ("load", "postprocess", "first_token", "total", "decode")}
        out["decode_tokens_per_s"] = round(self.decode_tokens / self.decode, 2) if self.decode else 0.0
        return out


@dataclass
class StepResult:
    seqs: list[Sequence]  # the sequences that ran (one new token each)
    finished: list[Sequence]
    prefill: bool


class LLMEngine:
    def __init__(self, cfg: ModelConfig, model: CausalLM, options: EngineOptions, timings: Timings,
                 platform: CpuPlatform, compile_cache: Path | None = None):
        self.cfg, self.model, self.options, self.timings = cfg, model, options, timings
        self.platform = platform
        self.kv_cache = self.new_kv_cache()
        self.blocks = BlockManager(self.kv_cache.num_blocks, options.block_size)
        self.scheduler = Scheduler(self.blocks, options.max_batch_tokens)
        self.model_dir: Path | None = None  # the checkpoint a cold start read (None after a restore)
        self.restored_from = None  # after a restore: where the state came from (snapshot id, weights hash)
        # control ops rank 0 may broadcast besides "step"/"stop" (e.g. "snapshot"), by name
        self.control_handlers: dict[str, Callable[[LLMEngine, dict], None]] = {"ping": lambda engine, msg: None}
        self.keep_logits = False  # tests: keep each step's logits in step_logits
        self.step_logits: list[torch.Tensor] = []
        self.compile_cache_dir: Path | None = None
        if options.compile:
            self.enable_compile(compile_cache)

    def new_kv_cache(self) -> KVCache:
        cfg, options = self.cfg, self.options
        return KVCache(cfg.num_hidden_layers, options.kv_cache_tokens // options.block_size, options.block_size,
                       len(self.model.layout.kv_heads), cfg.head_dim, options.torch_dtype)

    def enable_compile(self, cache_dir: Path | None = None) -> None:
        """Compile the dense FFN blocks, caching under ``cache_dir`` (default: a fresh private dir)."""
        from .compile import compile_model, configure_cache, private_cache_dir

        self.compile_cache_dir = configure_cache(cache_dir or private_cache_dir())
        compile_model(self.model)

    def warmup(self) -> None:
        """Run a prefill and a decode step so that compiled graphs exist before serving (or a snapshot)."""
        self.generate([[1, 2, 3]], max_tokens=2)

    @classmethod
    def cold_start(cls, model_dir: str | Path, options: EngineOptions | None = None,
                   rank: int = 0, world_size: int = 1) -> LLMEngine:
        """Read this rank's shard of the HF checkpoint in ``model_dir`` and post-process it.

        With ``world_size > 1`` the process group must already be formed
        (``comm_rebuild.groups.init_world``): W8A8 post-processing of
        row-parallel shards reduces scales over the tp group.
        """
        options = options or EngineOptions()
        timings = Timings()
        platform = get_platform(options.platform)
        cfg = ModelConfig.load(model_dir)
        plan = ShardPlan.build(cfg, world_size)
        reader = CheckpointReader(model_dir)
        model = CausalLM(cfg, plan.layouts[rank])
        load_checkpoint(model, reader, options.torch_dtype)
        timings.load = time.perf_counter() - timings.started
        t = time.perf_counter()
        platform.postprocess(model, options.quant)
        timings.postprocess = time.perf_counter() - t
        engine = cls(cfg, model, options, timings, platform)
        engine.model_dir = Path(model_dir)
        return engine

    # --- generation -------------------------------------------------------

    def add_request(self, prompt: list[int], max_tokens: int) -> Sequence:
        self.validate_request(prompt, max_tokens)
        seq = Sequence(list(prompt), max_tokens)
        self.scheduler.add(seq)
        return seq

    def validate_request(self, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise PodsnapError("the prompt is empty: give at least one token id")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise PodsnapError(f"token id(s) {bad[:5]} out of range: valid ids are 0..{self.cfg.vocab_size - 1}")
        if max_tokens < 1:
            raise PodsnapError(f"max_tokens={max_tokens} must be at least 1")
        limit = self.cfg.max_position_embeddings
        if len(prompt) + max_tokens > limit:
            raise PodsnapError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds "
                               f"the model's max_position_embeddings={limit}")
        if len(prompt) + max_tokens > self.options.kv_cache_tokens:
            raise PodsnapError(f"prompt + max_tokens = {len(prompt) + max_tokens} tokens do not fit the "
                               f"KV cache of {self.options.kv_cache_tokens} tokens")

    def step(self) -> StepResult:
        """Run one scheduled step: every sequence in it gets one token."""
        seqs, prefill = self.scheduler.schedule()
        logits = self.forward(seqs)
        if self.keep_logits:
            self.step_logits.append(logits)
        return StepResult(seqs, self.scheduler.finish_step(seqs, logits.argmax(dim=-1).tolist()), prefill)

    def forward(self, seqs: list[Sequence], last_only: bool = True) -> torch.Tensor:
        ids, positions, slots, query_lens, context = [], [], [], [], []
        for seq in seqs:
            start, stop = seq.num_cached, len(seq)
            ids.extend(seq.token_ids[start:stop])
            positions.extend(range(start, stop))
            slots.append(self.blocks.slots(seq.block_table, start, stop))
            query_lens.append(stop - start)
            context.append(self.blocks.slots(seq.block_table, 0, stop))
        ctx = StepContext(torch.tensor(positions), torch.cat(slots), query_lens, context)
        input_ids = torch.tensor(ids)
        if self.world_size > 1:
            tp.broadcast_step({"op": "step", "ids": input_ids, "ctx": ctx, "last_only": last_only})
        return self.model(input_ids, ctx, self.kv_cache, last_only)

    # --- ranks ----------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.model.layout.rank

    @property
    def world_size(self) -> int:
        return self.model.layout.world_size

    def follow(self) -> None:
        """Followers: run the steps rank 0 broadcasts until it sends "stop"."""
        while True:
            msg = tp.broadcast_step()
            if msg["op"] == "stop":
                return
            if msg["op"] == "step":
                self.model(msg["ids"], msg["ctx"], self.kv_cache, msg["last_only"])
            elif msg["op"] in self.control_handlers:
                self.control_handlers[msg["op"]](self, msg)
            else:
                raise PodsnapError(f"rank {self.rank}: unknown control op {msg['op']!r} from rank 0")

    def collective(self, msg: dict):
        """Rank 0: run control op ``msg["op"]`` on every rank (followers via broadcast) at this step boundary."""
        handler = self.control_handlers.get(msg["op"])
        if handler is None:
            raise PodsnapError(f"no handler for control op {msg['op']!r} on this engine")
        if self.world_size > 1:
            tp.broadcast_step(msg)
        return handler(self, msg)

    def stop_followers(self) -> None:
        """Release the followers from ``follow()``; a follower that is already gone is not an error."""
        if self.world_size == 1:
            return
        try:
            tp.broadcast_step({"op": "stop"})
        except RuntimeError as e:  # gloo raises when a peer has exited (e.g. SIGTERM to every pod)
            print(f"podsnap: rank 0 could not reach every follower at shutdown: {str(e).splitlines()[0]}",
                  file=sys.stderr)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy tokens for each prompt (batched)."""
        seqs = [self.add_request(p, max_tokens) for p in prompts]
        while self.scheduler.has_work:
            t = time.perf_counter()
            result = self.step()
            took = time.perf_counter() - t
            if result.prefill and not self.timings.first_token:
                self.timings.first_token = took
            elif not result.prefill:
                self.timings.decode += took
                self.timings.decode_tokens += len(result.seqs)
        self.timings.total = time.perf_counter() - self.timings.started
        return [s.output_ids for s in seqs]

    # --- engine state contract ---------------------------------------------

    def state(self, with_kv: bool = False) -> EngineState:
        metas = self.model.state_meta()
        named = dict(self.model.named_parameters())
        named.update(self.model.named_buffers())
        tensors = [StateTensor(name, metas[name], t) for name, t in named.items()]
        if with_kv:
            tensors += [StateTensor(f"kv_cache.{n}", TensorMeta(Role.KV, "paged"), getattr(self.kv_cache, n))
                        for n in ("k", "v")]
        return EngineState(self.rank, self.world_size, tensors)

    def drop_state(self) -> int:
        """Free the weights, derived tables and KV cache (a process checkpoint then leaves them out of
        its image; they are in the store). Running sequences must have been preempted. Returns the bytes
        freed."""
        freed = self.model.drop_state() + self.kv_cache.k.nbytes + self.kv_cache.v.nbytes
        self.kv_cache = None
        return freed

    def refill_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of ``drop_state``: the tensors of this rank (from the store) and an empty KV cache."""
        self.model.load_state(tensors)
        self.kv_cache = self.new_kv_cache()
