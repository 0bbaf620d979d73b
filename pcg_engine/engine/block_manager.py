"""Paged KV blocks: reference counts and a hash-chained prefix cache.

Block 0 is the scratch block. Padding rows of a graphed step carry slot -1, which the KV write sends
there, so it is never handed to a request. Usable blocks are 1 .. num_blocks-1.

Prefix cache. Once all block_size tokens of a block are computed and known (no PLACEHOLDER), the
block is published under hash(parent_hash, tokens): chaining on the parent makes the key stand for
the whole prefix, so equal blocks after different prefixes never match. The block also records its
parent hash and tokens, and a lookup compares them, so a colliding hash cannot produce a wrong hit.
A freed published block stays findable while free; it is evicted (its hash dropped) only when it is
handed out again, least recently freed first, and only after the free blocks that hold nothing.

A request's block table only ever grows by appending: the persistent batch copies just the new ids.
"""

from array import array
from collections import OrderedDict, deque
from hashlib import sha256

import numpy as np

from pcg_engine.engine.bulk_publish import publish_rows
from pcg_engine.engine.request import PLACEHOLDER, Request, RequestStatus

SCRATCH_BLOCK = 0


def hash_block(parent: bytes | None, tokens) -> bytes:
    """Stable across processes (unlike hash()), so a cache key means the same thing everywhere."""
    h = sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "_tokens")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = None          # set while published in the prefix cache
        self.parent_hash = None
        self._tokens = None       # kept to verify lookups: a tuple, or its int64 bytes (bulk_publish.py)

    @property
    def tokens(self) -> tuple | None:
        tokens = self._tokens
        if tokens.__class__ is bytes:
            tokens = self._tokens = tuple(memoryview(tokens).cast("q"))
        return tokens

    @tokens.setter
    def tokens(self, value) -> None:
        self._tokens = value

    def forget(self) -> None:
        self.hash = self.parent_hash = self._tokens = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn=hash_block):
        if num_blocks < 2:
            raise ValueError(f"num_blocks: must be >= 2 (block 0 is the scratch block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain = deque(range(1, num_blocks))   # free, nothing worth keeping: used first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free but published: LRU order
        self._hash_to_block: dict[bytes, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}        # chained hashes of each request's known full blocks
        self._blocks_view = None                          # (token array, its blocks view): bulk_publish.py

    # Sizes ---------------------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, evictable cached ones included."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks published in the prefix cache, in use or not."""
        return len(self._hash_to_block)

    def cdiv_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # Lookup --------------------------------------------------------------------------------------

    def _lookup(self, request: Request) -> tuple[list[int], list[bytes]]:
        """Blocks of the longest cached prefix of request.token_ids, and their hashes.

        Stops one token short of the end: the last token is always computed, so the step that
        runs it produces the logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], []
        tokens, bs = request.token_ids, self.block_size
        block_ids, hashes, parent = [], [], None
        for i in range((len(tokens) - 1) // bs):
            chunk = tokens[i * bs:(i + 1) * bs]
            if PLACEHOLDER in chunk:
                break
            h = self.hash_fn(parent, chunk)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.tokens != tuple(chunk):
                break                                     # hash collision: not our prefix
            block_ids.append(block_id)
            hashes.append(h)
            parent = h
        return block_ids, hashes

    def get_num_cached_prefix_tokens(self, request: Request) -> int:
        """Tokens a first allocation of `request` would take from the cache. No side effects."""
        return len(self._lookup(request)[0]) * self.block_size

    # Allocation ----------------------------------------------------------------------------------

    def _plan(self, request: Request, num_new_tokens: int):
        """(prefix blocks, their hashes, computed tokens, fresh blocks needed, free blocks consumed)."""
        table = self._tables.get(request.request_id)
        if table is not None:
            hits, hashes, computed, have = [], [], request.num_computed_tokens, len(table)
        else:
            hits, hashes = self._lookup(request)
            have = len(hits)
            computed = have * self.block_size
        fresh = max(0, self.cdiv_blocks(computed + num_new_tokens) - have)
        # A cached prefix block that nobody holds is counted as free: claiming it uses one up.
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return hits, hashes, computed, fresh, fresh + revived

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self._plan(request, num_new_tokens)[4] <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Ensure blocks for request.num_computed_tokens + num_new_tokens tokens.

        A request without blocks (new, or preempted) first claims its longest cached prefix and
        starts computing after it: num_computed_tokens (and, on its first schedule,
        num_cached_tokens) are set to the prefix length. Returns False, changing nothing, when
        the free blocks do not suffice.
        """
        table = self._tables.get(request.request_id)
        if table is not None:
            # Fast path, every running request every step: it already holds blocks, so there is no
            # prefix lookup; usually its last block still has room and nothing changes.
            fresh = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(table)
            if fresh <= 0:
                return True
            if fresh > len(self._free_plain) + len(self._free_cached):
                return False
            for _ in range(fresh):
                table.append(self._pop_free())
            return True
        hits, hashes, computed, fresh, cost = self._plan(request, num_new_tokens)
        if cost > self.num_free_blocks:
            return False
        rid = request.request_id
        table = self._tables[rid] = []
        for block_id in hits:                 # claim before taking fresh blocks, or we might evict them
            self._take(block_id)
            table.append(block_id)
        self._hashes[rid] = hashes
        request.num_computed_tokens = computed
        if request.status == RequestStatus.WAITING:
            request.num_cached_tokens = computed
        for _ in range(fresh):
            table.append(self._pop_free())
        return True

    def grow(self, request_ids: list[str], counts: list[int]) -> list[int]:
        """Append counts[i] fresh blocks to request_ids[i]'s table, for requests that hold blocks
        already. Returns the new block ids in order."""
        if counts.count(1) == len(counts):
            return self.grow_one_each(request_ids)
        if sum(counts) > self.num_free_blocks:
            raise RuntimeError("grow: not enough free blocks")
        new, pop, tables = [], self._pop_free, self._tables
        for rid, k in zip(request_ids, counts):
            table = tables[rid]
            for _ in range(k):
                block_id = pop()
                table.append(block_id)
                new.append(block_id)
        return new

    def grow_one_each(self, request_ids: list[str]) -> list[int]:
        """grow() by one block each (the scheduler's decode fast path, which checks first that
        enough are free and falls back to its general loop, where preemption happens, when not;
        here too few is a RuntimeError): the plain free list first, then the least recently freed
        cached blocks, in one pass each, as _pop_free would hand them out. At batch 256 with every free block
        cached, 256 evictions through _pop_free took 309 us on the dev VM against 90-99 us in bulk
        (the per-call and per-request loop overhead)."""
        total, plain = len(request_ids), self._free_plain
        if total > len(plain) + len(self._free_cached):
            raise RuntimeError("grow: not enough free blocks")
        from_plain = min(total, len(plain))
        new = [plain.popleft() for _ in range(from_plain)]
        if from_plain < total:
            new += self._evict(total - from_plain)
        tables, blocks = self._tables, self.blocks
        for rid, block_id in zip(request_ids, new):
            tables[rid].append(block_id)
            blocks[block_id].ref_count = 1
        return new

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id = self._free_plain.popleft() if self._free_plain else self._evict(1)[0]
        self.blocks[block_id].ref_count = 1
        return block_id

    def _evict(self, k: int) -> list[int]:
        """k cached free blocks, least recently freed first, out of the prefix cache (ref counts
        are the caller's to set)."""
        pop, blocks, hash_to_block = self._free_cached.popitem, self.blocks, self._hash_to_block
        out = []
        for _ in range(k):
            block_id = pop(False)[0]
            block = blocks[block_id]
            del hash_to_block[block.hash]
            block.hash = block.parent_hash = block._tokens = None      # Block.forget, inlined
            out.append(block_id)
        return out

    def free(self, request: Request) -> None:
        """Release the request's blocks. Published ones stay in the cache. Idempotent."""
        table = self._tables.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        if table is None:
            return
        # Tail first: the LRU then evicts a request's last blocks before its (more shareable) prefix.
        for block_id in reversed(table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._free_cached[block_id] = None
                else:
                    self._free_plain.append(block_id)

    # Publishing ----------------------------------------------------------------------------------

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that became full and known since the last call.

        Stops at the first block not fully computed or holding a PLACEHOLDER (its hash would be
        wrong); the engine calls again once the placeholder is resolved.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.get(request.request_id)
        # Cheap exit first: called for every scheduled request after each launch and each resolve,
        # but a block fills only every block_size tokens. No block beyond the computed tokens can
        # be published, so with one hash per computed full block there is nothing to do.
        computed = request.num_computed_tokens
        if hashes is None or computed // self.block_size <= len(hashes):
            return
        table = self._tables[request.request_id]
        tokens, bs = request.token_ids, self.block_size
        num_full = min(computed, len(tokens), len(table) * bs) // bs
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            chunk = tokens[i * bs:(i + 1) * bs]
            if PLACEHOLDER in chunk:
                break
            h = self.hash_fn(parent, chunk)
            hashes.append(h)
            block = self.blocks[table[i]]
            # Same content computed twice (or a collision): keep the first copy, leave this one private.
            if block.hash is None and h not in self._hash_to_block:
                block.hash, block.parent_hash, block.tokens = h, parent, tuple(chunk)
                self._hash_to_block[h] = block.block_id
            parent = h

    def cache_full_blocks_rows(self, requests, token_ids: np.ndarray, rows: np.ndarray,
                               num_full: np.ndarray) -> None:
        """cache_full_blocks for requests bound to rows of one token array, in one go
        (bulk_publish.py): requests[i] holds its tokens in token_ids[rows[i]] and has num_full[i]
        full blocks of computed tokens (min(computed, tokens) // block_size)."""
        if self.enable_prefix_caching and len(requests):
            publish_rows(self, requests, token_ids, rows, num_full,
                         None if self.hash_fn is hash_block else self.hash_fn)

    def reset_prefix_cache(self) -> bool:
        """Forget every published block, so the next request finds no cached prefix (a benchmark's
        measured run starts cold). Only while no request holds a block: a running request's published
        blocks are in use and its later blocks chain on their hashes, so the cache could not be made
        cold under it. Returns False, changing nothing, then. The forgotten blocks join the plain
        free list: the free-block count is unchanged."""
        if self._tables:
            return False
        for block_id in self._free_cached:        # least recently freed first, as eviction would take them
            self.blocks[block_id].forget()
            self._free_plain.append(block_id)
        self._free_cached.clear()
        self._hash_to_block.clear()
        return True

    # Addressing ----------------------------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in order. The live list: read it, don't modify it."""
        return self._tables.get(request_id, [])

    def slot(self, request_id: str, position: int) -> int:
        """KV slot (block * block_size + offset) of a token position."""
        block_id = self._tables[request_id][position // self.block_size]
        return block_id * self.block_size + position % self.block_size

    # Checks (tests) ------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        usable = set(range(1, self.num_blocks))
        plain, cached = list(self._free_plain), list(self._free_cached)
        free = set(plain) | set(cached)
        assert len(free) == len(plain) + len(cached), "a block is free twice"
        holders = [0] * self.num_blocks
        for rid, table in self._tables.items():
            assert SCRATCH_BLOCK not in table, f"{rid} holds the scratch block"
            assert len(self._hashes[rid]) <= len(table), f"{rid} has hashes for blocks it lacks"
            for block_id, h in zip(table, self._hashes[rid]):
                assert self.blocks[block_id].hash in (None, h), f"{rid}: block {block_id} under another hash"
            for block_id in table:
                holders[block_id] += 1
        used = {b for b in usable if holders[b]}
        assert not (free & used), f"blocks both free and used: {sorted(free & used)}"
        assert free | used == usable, f"blocks neither free nor used: {sorted(usable - free - used)}"
        assert self.blocks[SCRATCH_BLOCK].ref_count == 0 and self.blocks[SCRATCH_BLOCK].hash is None
        for block in self.blocks[1:]:
            assert block.ref_count == holders[block.block_id], f"block {block.block_id}: refcount"
        assert all(self.blocks[b].hash is None for b in plain), "published block on the plain free list"
        assert all(self.blocks[b].hash is not None for b in cached), "unpublished block on the cached list"
        for h, block_id in self._hash_to_block.items():
            block = self.blocks[block_id]
            assert block.hash == h, f"block {block_id} is mapped under a hash it doesn't carry"
            assert len(block.tokens) == self.block_size and PLACEHOLDER not in block.tokens
            assert self.hash_fn(block.parent_hash, list(block.tokens)) == h, f"block {block_id}: tokens"
        published = {b.block_id for b in self.blocks if b.hash is not None}
        assert published == set(self._hash_to_block.values()), "hashed block missing from the map"
