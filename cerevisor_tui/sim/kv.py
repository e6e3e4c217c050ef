"""A paged KV cache like vLLM's: fixed-size blocks, prefix reuse by block hash, LRU eviction, a CPU tier.

Only counts and hashes are kept, never tensors. Full prompt blocks are registered under their chain
hash while a sequence holds them; when it ends they stay cached (evictable, in LRU order) until a new
allocation needs the room. An evicted block goes to the CPU tier when there is one, from where a later
request reloads it instead of recomputing it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class KvHold:
    """The blocks one sequence holds: shared hashed blocks (a prefix) and private ones."""

    hashed: list[int] = field(default_factory=list)
    private: int = 0

    @property
    def blocks(self) -> int:
        return len(self.hashed) + self.private


@dataclass
class Admission:
    """What admitting a prompt found: tokens hit in GPU memory, reloaded from CPU, to compute."""

    gpu_hit_tokens: int
    cpu_hit_tokens: int
    compute_tokens: int


class KvCache:
    """Block accounting for one server: `num_blocks` GPU blocks, `cpu_blocks` in the CPU tier."""

    def __init__(self, num_blocks: int, block_size: int = 16, cpu_blocks: int = 0) -> None:
        self.num_blocks = max(1, num_blocks)
        self.block_size = block_size
        self.cpu_blocks = max(0, cpu_blocks)
        self.used_blocks = 0  # blocks referenced by some sequence
        self._refs: dict[int, int] = {}  # hashed blocks in use -> reference count
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused; oldest first
        self._cpu: OrderedDict[int, None] = OrderedDict()
        self.watermark_blocks = max(0, self.num_blocks // 100)  # vLLM keeps ~1% free at admission
        # Counters, in tokens as vLLM counts them.
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.cpu_queries_tokens = 0
        self.cpu_hits_tokens = 0
        self.evicted_blocks = 0
        self.cpu_stored_blocks = 0  # evicted blocks copied to the CPU tier (vllm:kv_offload_store_bytes)
        self.cpu_loaded_blocks = 0  # blocks reloaded from it (vllm:kv_offload_load_bytes)
        self.releases = 0  # bumped whenever blocks come back, so a blocked admission knows to retry

    # ---- views --------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of GPU blocks held by sequences (vllm:kv_cache_usage_perc)."""
        return self.used_blocks / self.num_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take: never used plus cached-but-evictable."""
        return self.num_blocks - self.used_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._refs) + len(self._evictable)

    @property
    def cpu_used_blocks(self) -> int:
        return len(self._cpu)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # ---- allocation -------------------------------------------------------------------------
    def _take_blocks(self, n: int) -> bool:
        """Mark `n` blocks used: never-used ones first, then evict cached ones oldest first."""
        evictable = self._evictable
        if n > self.num_blocks - self.used_blocks:
            return False
        fresh = min(n, self.num_blocks - self.used_blocks - len(evictable))
        self.used_blocks += n
        cpu, cpu_cap = self._cpu, self.cpu_blocks
        for _ in range(n - fresh):
            victim, _ = evictable.popitem(last=False)
            if cpu_cap:
                cpu[victim] = None
                cpu.move_to_end(victim)
                self.cpu_stored_blocks += 1
        self.evicted_blocks += n - fresh
        while len(cpu) > cpu_cap:
            cpu.popitem(last=False)
        return True

    def try_admit(self, hashes: list[int], tokens: int, hold: KvHold, *, count: bool = True) -> Admission | None:
        """Give a prompt of `tokens` (full-block `hashes`) its blocks, or None when they do not fit."""
        gpu_hits = 0
        evictable_hits = 0
        for h in hashes:
            if h in self._refs:
                gpu_hits += 1
            elif h in self._evictable:
                gpu_hits += 1
                evictable_hits += 1
            else:
                break
        cpu_hits = 0
        if self.cpu_blocks:
            for h in hashes[gpu_hits:]:
                if h in self._cpu:
                    cpu_hits += 1
                else:
                    break
        need_total = self.blocks_for(tokens + 1)  # room for the first generated token too
        need_new = need_total - gpu_hits
        available = self.num_blocks - self.used_blocks - evictable_hits
        if need_new > available - self.watermark_blocks and self.used_blocks > 0:
            return None
        if need_new > available:
            return None
        for h in hashes[:gpu_hits]:
            if h in self._refs:
                self._refs[h] += 1
            else:
                del self._evictable[h]
                self._refs[h] = 1
                self.used_blocks += 1
            hold.hashed.append(h)
        self._take_blocks(need_new)
        refs, evictable, cpu = self._refs, self._evictable, self._cpu
        for h in hashes[gpu_hits:]:
            if h in refs or h in evictable:
                hold.private += 1  # a duplicate past the first miss: not shared
            else:
                refs[h] = 1
                cpu.pop(h, None)
                hold.hashed.append(h)
        hold.private += need_total - len(hashes)
        bs = self.block_size
        gpu_hit_tokens = min(gpu_hits * bs, tokens)
        self.cpu_loaded_blocks += cpu_hits
        cpu_hit_tokens = min(cpu_hits * bs, tokens - gpu_hit_tokens)
        if count:
            self.queries_tokens += tokens
            self.hits_tokens += gpu_hit_tokens
            if self.cpu_blocks:
                self.cpu_queries_tokens += tokens - gpu_hit_tokens
                self.cpu_hits_tokens += cpu_hit_tokens
        return Admission(gpu_hit_tokens, cpu_hit_tokens, tokens - gpu_hit_tokens - cpu_hit_tokens)

    def grow(self, hold: KvHold, tokens: int) -> bool:
        """Make `hold` big enough for `tokens`; False when no block is free (the caller preempts)."""
        missing = self.blocks_for(tokens) - len(hold.hashed) - hold.private
        if missing <= 0:
            return True
        if not self._take_blocks(missing):
            return False
        hold.private += missing
        return True

    def release(self, hold: KvHold, *, keep_cached: bool = True) -> None:
        """Give back a sequence's blocks; its hashed ones stay cached, tail first in line for eviction
        (with `keep_cached` False those no one else holds are dropped from the prefix cache too)."""
        self.releases += 1
        self.used_blocks -= hold.private
        hold.private = 0
        for h in reversed(hold.hashed):
            n = self._refs[h] - 1
            if n:
                self._refs[h] = n
            else:
                del self._refs[h]
                if keep_cached:
                    self._evictable[h] = None
                self.used_blocks -= 1
        hold.hashed.clear()
