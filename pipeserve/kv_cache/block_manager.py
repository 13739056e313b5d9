"""The one logical KV block table shared by every pipeline stage.

Each stage holds the physical KV of its own layers, indexed by the block ids
chosen here, so a single block manager in the driver serves all stages.

Block states (every device block is in exactly one):
  - free:      refcount 0, no cached content;
  - evictable: refcount 0 but holds the KV of a registered full block, kept
    for prefix-cache hits and evicted least-recently-released first;
  - held:      refcount > 0, in the block tables of ``refcount`` sequences.

A full block is registered in the prefix cache only once its KV exists
(``register_computed`` after the step that computed it), so a sequence can
never share a block whose KV is still being written.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from pipeserve.kv_cache.host_pool import HostBlockPool
from pipeserve.kv_cache.prefix_hash import block_tokens, chain_root, extend_chain
from pipeserve.sequence import Sequence


class KVCacheIntegrityError(RuntimeError):
    """The block manager's bookkeeping is inconsistent (a bug, never user error)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True,
                 kv_variant: Callable[[Sequence], int] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}: give the KV cache more memory")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Which KV a sequence computes for its tokens now (0 unless the model's KV
        # depends on more than the tokens: longrope); variants never share blocks.
        self._kv_variant = kv_variant or (lambda seq: 0)
        self.host = HostBlockPool(num_host_blocks)
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: dict[int, tuple[int, ...]] = {}       # registered block -> its token ids
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self._hash_to_block: dict[int, int] = {}
        self._holders: dict[int, Sequence] = {}             # seq_id -> seq holding device blocks
        self._chains: dict[int, list[int]] = {}             # seq_id -> keys of its full computed blocks
        self._pending: dict[int, list[int]] = {}            # seq_id -> swapped-in block indices to register
        self._counters = dict(query_tokens=0, hit_tokens=0, query_blocks=0, hit_blocks=0, evictions=0)

    # -- sizes ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` tokens fits in the whole cache."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    # ``start`` below: the tokens before the new ones, whose slots the table already
    # covers; default the computed ones. The scheduler passes the end of a prompt's
    # chunks still in flight, whose slots are allocated but not yet computed.
    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int, start: int | None = None) -> int:
        start = seq.num_computed_tokens if start is None else start
        return max(0, self.blocks_for(start + num_new_tokens) - len(seq.block_table))

    def num_fitting_tokens(self, seq: Sequence, start: int | None = None) -> int:
        """How many more tokens ``seq`` could compute after ``start`` with the blocks free now."""
        start = seq.num_computed_tokens if start is None else start
        capacity = (len(seq.block_table) + self.num_free_blocks) * self.block_size
        return max(0, capacity - start)

    # -- admission -----------------------------------------------------------
    def admit(self, seq: Sequence, max_new_tokens: int, allow_partial: bool = True,
              share_from: Sequence | None = None) -> int:
        """Give a sequence without blocks its shared leading blocks and the slots
        of its first chunk, all or nothing.

        Leading blocks come from ``share_from`` (a fork: its full prompt blocks)
        or else from the prefix cache; at least one token is always left to
        compute, since its logits are needed. Returns the number of tokens to
        compute this step (0: not admitted; nothing changed).
        """
        if seq.block_table or seq.seq_id in self._holders:
            raise RuntimeError(f"{seq} already holds blocks")
        if share_from is not None:
            shared, chain = self._fork_blocks(seq, share_from)
        else:
            shared, chain = self._cached_prefix(seq)
        num_shared_tokens = len(shared) * self.block_size
        remaining = seq.num_tokens - num_shared_tokens
        num_new = min(remaining, max_new_tokens)
        if num_new < 1 or (num_new < remaining and not allow_partial):
            return 0
        num_fresh = self.blocks_for(num_shared_tokens + num_new) - len(shared)
        num_revived = sum(1 for b in shared if self._ref[b] == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return 0
        for block in shared:        # before allocating, so eviction cannot take them
            self._acquire(block)
        seq.block_table = shared + [self._allocate() for _ in range(num_fresh)]
        seq.num_computed_tokens = num_shared_tokens
        seq.num_cached_tokens = min(num_shared_tokens, seq.num_prompt_tokens)
        self._holders[seq.seq_id] = seq
        self._chains[seq.seq_id] = chain
        if share_from is None and self.enable_prefix_caching:
            self._count_query(seq, len(shared))
        return num_new

    def _cached_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Leading full blocks of ``seq`` found in the prefix cache, and their keys."""
        if not self.enable_prefix_caching:
            return [], []
        chain: list[int] = []
        blocks: list[int] = []
        root = chain_root(self._kv_variant(seq))
        for index in range((seq.num_tokens - 1) // self.block_size):
            extend_chain(chain, seq.token_ids, index + 1, self.block_size, root)
            block = self._hash_to_block.get(chain[-1])
            if block is None or self._tokens[block] != block_tokens(seq.token_ids, index, self.block_size):
                chain.pop()
                break
            blocks.append(block)
        return blocks, chain

    def _fork_blocks(self, seq: Sequence, parent: Sequence) -> tuple[list[int], list[int]]:
        """The parent's full prompt blocks that ``seq`` may share (its KV is computed)."""
        limit = min(seq.num_prompt_tokens // self.block_size,
                    (seq.num_tokens - 1) // self.block_size,
                    parent.num_computed_tokens // self.block_size,
                    len(parent.block_table))
        if seq.token_ids[:limit * self.block_size] != parent.token_ids[:limit * self.block_size]:
            raise RuntimeError(f"cannot fork {seq} from {parent}: their prompts differ")
        chain = self._chains.get(parent.seq_id, [])[:limit]
        return list(parent.block_table[:limit]), list(chain)

    def _count_query(self, seq: Sequence, num_hit_blocks: int) -> None:
        c = self._counters
        c["query_tokens"] += seq.num_tokens
        c["hit_tokens"] += num_hit_blocks * self.block_size
        c["query_blocks"] += (seq.num_tokens - 1) // self.block_size
        c["hit_blocks"] += num_hit_blocks

    # -- growth and release --------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, start: int | None = None) -> bool:
        """Make ``seq``'s table cover ``num_new_tokens`` more tokens after ``start``; all or nothing."""
        needed = self.new_blocks_needed(seq, num_new_tokens, start)
        if needed > self.num_free_blocks:
            return False
        seq.block_table.extend(self._allocate() for _ in range(needed))
        if seq.block_table:
            self._holders[seq.seq_id] = seq
        return True

    def register_computed(self, seq: Sequence) -> None:
        """Enter ``seq``'s newly computed full blocks in the prefix cache.

        Call after the step that computed them is done: before that their KV
        does not exist yet and no other sequence may share them.
        """
        if not self.enable_prefix_caching or seq.seq_id not in self._holders:
            return
        chain = self._chains.setdefault(seq.seq_id, [])
        for index in self._pending.pop(seq.seq_id, []):
            self._register(seq.block_table[index], chain[index], seq, index)
        start = len(chain)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        extend_chain(chain, seq.token_ids, num_full, self.block_size, chain_root(self._kv_variant(seq)))
        for index in range(start, num_full):
            self._register(seq.block_table[index], chain[index], seq, index)

    def _register(self, block: int, key: int, seq: Sequence, index: int) -> None:
        # A duplicate (same content already cached in another block) stays
        # unregistered and is simply freed when released.
        if key in self._hash_to_block or self._hash[block] is not None:
            return
        self._hash[block] = key
        self._hash_to_block[key] = block
        self._tokens[block] = block_tokens(seq.token_ids, index, self.block_size)

    def free(self, seq: Sequence) -> None:
        """Release every device and host block ``seq`` holds."""
        self._release_table(seq)
        self.host.release(seq.seq_id)
        self._chains.pop(seq.seq_id, None)
        self._pending.pop(seq.seq_id, None)

    def _release_table(self, seq: Sequence) -> None:
        # Tail first: the last blocks of a sequence are the least likely to be
        # shared again, so they should be evicted before its leading ones.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        self._holders.pop(seq.seq_id, None)

    # -- swap ----------------------------------------------------------------
    def _blocks_to_swap(self, seq: Sequence) -> int:
        return min(len(seq.block_table), self.blocks_for(seq.num_computed_tokens))

    def can_swap_out(self, seq: Sequence) -> bool:
        return self._blocks_to_swap(seq) <= self.host.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move ``seq``'s computed KV to the host pool; returns (device, host) copies
        that every stage must run before this step reuses the device blocks."""
        keep = self._blocks_to_swap(seq)
        host_blocks = self.host.allocate(seq.seq_id, keep)
        mapping = list(zip(seq.block_table[:keep], host_blocks))
        self._pending.pop(seq.seq_id, None)
        self._release_table(seq)
        return mapping

    def _swap_in_plan(self, seq: Sequence) -> list[int | None]:
        """Per host block: a device block that already caches its KV, or None (copy)."""
        chain = self._chains.get(seq.seq_id, []) if self.enable_prefix_caching else []
        plan: list[int | None] = []
        for index in range(len(self.host.table(seq.seq_id))):
            plan.append(self._hash_to_block.get(chain[index]) if index < len(chain) else None)
        return plan

    def can_swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> bool:
        plan = self._swap_in_plan(seq)
        needed = sum(1 for b in plan if b is None or self._ref[b] == 0)
        needed += max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(plan))
        return needed <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence's KV back; returns the (host, device) copies.
        Blocks whose KV is still cached on the device are shared, not copied."""
        plan = self._swap_in_plan(seq)
        needed = sum(1 for b in plan if b is None or self._ref[b] == 0)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"cannot swap in {seq}: check can_swap_in() first")
        for block in plan:
            if block is not None:
                self._acquire(block)
        host_blocks = self.host.table(seq.seq_id)
        table = [b if b is not None else self._allocate() for b in plan]
        mapping = [(h, d) for h, d, b in zip(host_blocks, table, plan) if b is None]
        chain_len = len(self._chains.get(seq.seq_id, []))
        self._pending[seq.seq_id] = [i for i, b in enumerate(plan) if b is None and i < chain_len]
        self.host.release(seq.seq_id)
        seq.block_table = table
        self._holders[seq.seq_id] = seq
        return mapping

    # -- losing the KV ----------------------------------------------------------
    def drop_all_kv(self, seqs: list[Sequence]) -> None:
        """Every stage's cache was lost or replaced (a stage restarted): each block
        misses at least the dead stage's layers, so no block's KV is usable. Free
        ``seqs`` (every sequence holding device or host blocks) and forget the whole
        prefix cache, so no lookup can hit a block whose KV is gone."""
        for seq in seqs:
            self.free(seq)
        if self._holders or self.host.num_free != self.host.num_blocks:
            raise KVCacheIntegrityError("drop_all_kv: a sequence still holds blocks; pass every holder")
        for block in list(self._evictable):
            self._forget(block)
            self._free.append(block)
        self._evictable.clear()

    # -- block primitives ----------------------------------------------------
    def _allocate(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            self._counters["evictions"] += 1
        self._ref[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._evictable[block]
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] > 0:
            return
        if self._hash[block] is not None:
            self._evictable[block] = None
        else:
            self._free.append(block)

    def _forget(self, block: int) -> None:
        key = self._hash[block]
        if key is not None:
            del self._hash_to_block[key]
            del self._tokens[block]
            self._hash[block] = None

    # -- introspection -------------------------------------------------------
    def stats(self) -> dict:
        c = self._counters
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_cached_blocks": len(self._hash_to_block),
            "usage": self.usage,
            "num_host_blocks": self.host.num_blocks,
            "num_free_host_blocks": self.host.num_free,
            "prefix_cache_query_tokens": c["query_tokens"],
            "prefix_cache_hit_tokens": c["hit_tokens"],
            "prefix_cache_query_blocks": c["query_blocks"],
            "prefix_cache_hit_blocks": c["hit_blocks"],
            "prefix_cache_evictions": c["evictions"],
        }

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    def check_integrity(self) -> None:
        """Raise ``KVCacheIntegrityError`` if the bookkeeping is inconsistent.
        O(blocks + table entries): cheap enough to run whenever the engine is idle."""
        problems = self._device_problems() + self.host.check_integrity()
        if problems:
            raise KVCacheIntegrityError("; ".join(problems))

    def _device_problems(self) -> list[str]:
        problems: list[str] = []
        counts = [0] * self.num_blocks
        for seq_id, seq in self._holders.items():
            if len(set(seq.block_table)) != len(seq.block_table):
                problems.append(f"sequence {seq_id} holds a block twice")
            for block in seq.block_table:
                counts[block] += 1
        if counts != self._ref:
            bad = [b for b in range(self.num_blocks) if counts[b] != self._ref[b]][:5]
            problems.append(f"refcount != number of holding tables for blocks {bad}")
        free, evictable = set(self._free), set(self._evictable)
        held = {b for b in range(self.num_blocks) if self._ref[b] > 0}
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if free & held or evictable & held or free & evictable:
            problems.append("a block is both free (or evictable) and held")
        if len(free) + len(evictable) + len(held) != self.num_blocks:
            problems.append(f"free {len(free)} + evictable {len(evictable)} + held {len(held)} "
                            f"!= {self.num_blocks} blocks")
        if any(self._hash[b] is not None for b in free) or any(self._hash[b] is None for b in evictable):
            problems.append("a free block is cached or an evictable block is not")
        if any(self._hash[b] != h for h, b in self._hash_to_block.items()) or \
                sum(h is not None for h in self._hash) != len(self._hash_to_block):
            problems.append("prefix-cache index and block hashes disagree")
        return problems
