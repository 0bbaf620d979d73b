"""Block manager: allocation, reference counts, the hash-chained prefix cache, the scratch block."""

import random
from types import SimpleNamespace

import numpy as np
import pytest

from pcg_engine.engine.block_manager import SCRATCH_BLOCK, BlockManager, hash_block
from pcg_engine.engine.request import PLACEHOLDER, Request, RequestStatus

BS = 4


def req(rid, tokens, max_tokens=8):
    return Request(rid, tokens, SimpleNamespace(max_tokens=max_tokens))


def run_prefill(bm, r):
    """Allocate and 'compute' the whole known sequence, then publish, as a step would."""
    n = r.num_tokens - bm.get_num_cached_prefix_tokens(r)
    assert bm.allocate(r, n)
    r.num_computed_tokens += n
    bm.cache_full_blocks(r)
    bm.check_invariants()


def snapshot(bm, *requests):
    return (list(bm._free_plain), list(bm._free_cached), dict(bm._hash_to_block),
            {k: list(v) for k, v in bm._tables.items()}, [b.ref_count for b in bm.blocks],
            [(r.num_computed_tokens, r.num_cached_tokens) for r in requests])


def test_sizes_and_validation():
    bm = BlockManager(10, BS)
    assert bm.num_total_blocks == 9 and bm.num_free_blocks == 9 and bm.num_used_blocks == 0
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(1, BS)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_allocate_grows_by_appending_and_slots():
    bm = BlockManager(10, BS)
    r = req("a", list(range(10, 16)))                  # 6 tokens: 2 blocks
    assert bm.allocate(r, 6)
    table = list(bm.block_table("a"))
    assert len(table) == 2 and SCRATCH_BLOCK not in table
    r.num_computed_tokens = 6
    for _ in range(3):                                 # tokens 6..8 -> a third block
        r.append_output(1)
        assert bm.allocate(r, 1)
        r.num_computed_tokens += 1
    assert bm.block_table("a")[:2] == table and len(bm.block_table("a")) == 3
    t = bm.block_table("a")
    assert bm.slot("a", 0) == t[0] * BS
    assert bm.slot("a", 5) == t[1] * BS + 1
    assert bm.slot("a", 8) == t[2] * BS
    bm.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_grow_takes_the_blocks_allocate_would(seed):
    """grow (the scheduler's decode fast path) appends the same blocks, in the same order, as one
    allocate per request would, and returns them; it refuses to overdraw. One block each (the
    decode step's case) or any counts, from plain or evicted cached blocks."""
    import random
    rng = random.Random(seed)
    managers = [BlockManager(40, BS), BlockManager(40, BS)]
    prompts = [[rng.randint(3, 99) for _ in range(rng.randint(1, 9))] for _ in range(5)]
    if seed % 3 == 2:            # leave only cached blocks free: growing evicts them
        for bm in managers:
            filler = req("filler", list(range(4 * (bm.num_free_blocks - 12))))
            assert bm.allocate(filler, filler.num_tokens)
            filler.num_computed_tokens = filler.num_tokens
            bm.cache_full_blocks(filler)
            bm.free(filler)
    reqs = [[req(f"r{i}", p) for i, p in enumerate(prompts)] for _ in managers]
    for bm, rs in zip(managers, reqs):
        for r in rs:
            assert bm.allocate(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens
    counts = [1] * 5 if seed % 2 else [rng.randint(0, 2) for _ in range(5)]
    a, b = managers
    before = {rid: list(t) for rid, t in a._tables.items()}
    for r, k in zip(reqs[0], counts):
        assert a.allocate(r, (len(a.block_table(r.request_id)) + k) * BS - r.num_computed_tokens)
    new = b.grow([r.request_id for r in reqs[1]], counts)
    assert a._tables == b._tables and list(a._free_plain) == list(b._free_plain)
    assert list(a._free_cached) == list(b._free_cached) and a._hash_to_block == b._hash_to_block
    assert new == [x for r in reqs[0] for x in a.block_table(r.request_id)[len(before[r.request_id]):]]
    b.check_invariants()
    with pytest.raises(RuntimeError, match="not enough"):
        b.grow(["r0"], [b.num_free_blocks + 1])
    b.check_invariants()


def test_grow_one_block_each_takes_plain_blocks_then_evicts_the_least_recently_freed():
    """The decode step's grow when the plain free list runs out part-way: its first requests get
    plain blocks, the rest evict cached ones oldest first, exactly as one allocate per request."""
    managers = [BlockManager(16, BS), BlockManager(16, BS)]
    reqs = []
    for bm in managers:
        for name, tokens in (("old", list(range(100, 100 + 4 * BS))), ("new", list(range(200, 200 + 3 * BS)))):
            filler = req(name, tokens)           # freed first: its blocks are the least recently freed
            assert bm.allocate(filler, filler.num_tokens)
            filler.num_computed_tokens = filler.num_tokens
            bm.cache_full_blocks(filler)
            bm.free(filler)
        rs = [req(f"r{i}", [i + 1] * BS) for i in range(6)]
        for r in rs:                             # one full block each, from the plain list
            assert bm.allocate(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens
        reqs.append(rs)
    a, b = managers
    assert len(a._free_plain) == 2 and len(a._free_cached) == 7
    old_hashes = [a.blocks[x].hash for x in list(a._free_cached)[:4]]
    for r in reqs[0]:
        assert a.allocate(r, BS)
    new = b.grow([r.request_id for r in reqs[1]], [1] * 6)
    assert a._tables == b._tables and list(a._free_plain) == list(b._free_plain) == []
    assert list(a._free_cached) == list(b._free_cached) and a._hash_to_block == b._hash_to_block
    assert new == [a.block_table(r.request_id)[-1] for r in reqs[0]]
    assert all(h not in b._hash_to_block for h in old_hashes)       # the oldest four were evicted
    assert all(b.blocks[x].hash is None and b.blocks[x].ref_count == 1 for x in new)
    b.check_invariants()


def test_full_hit_except_last_token():
    bm = BlockManager(20, BS)
    prompt = list(range(100, 109))                     # 9 tokens: 2 full blocks + 1
    a = req("a", prompt)
    run_prefill(bm, a)
    b = req("b", prompt)
    assert bm.get_num_cached_prefix_tokens(b) == 8
    assert bm.allocate(b, 1)
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]


def test_exact_multiple_prompt_recomputes_last_block():
    bm = BlockManager(20, BS)
    prompt = list(range(8))                            # exactly 2 blocks
    run_prefill(bm, req("a", prompt))
    b = req("b", prompt)
    # The last token must be computed, so the block holding it can't come from the cache.
    assert bm.get_num_cached_prefix_tokens(b) == 4
    assert bm.allocate(b, 4) and b.num_computed_tokens == 4


def test_partial_hit():
    bm = BlockManager(20, BS)
    run_prefill(bm, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 0, 9, 9])       # second block differs
    assert bm.get_num_cached_prefix_tokens(b) == 4
    assert bm.allocate(b, 6) and b.num_computed_tokens == 4
    assert bm.block_table("b")[0] == bm.block_table("a")[0]


def test_hashes_are_chained_on_the_prefix():
    bm = BlockManager(20, BS)
    run_prefill(bm, req("a", [1, 1, 1, 1, 7, 7, 7, 7, 0]))
    b = req("b", [2, 2, 2, 2, 7, 7, 7, 7, 0])          # same second block, other first block
    assert bm.get_num_cached_prefix_tokens(b) == 0
    run_prefill(bm, b)
    assert set(bm.block_table("a")).isdisjoint(bm.block_table("b"))


def test_hash_collision_never_hits():
    bm = BlockManager(20, BS, hash_fn=lambda parent, tokens: b"same")
    run_prefill(bm, req("a", [1, 2, 3, 4, 5]))
    b = req("b", [9, 9, 9, 9, 5])
    assert bm.get_num_cached_prefix_tokens(b) == 0
    run_prefill(bm, b)                                  # its block is not published over a's
    assert bm.num_cached_blocks == 1
    assert bm.get_num_cached_prefix_tokens(req("c", [1, 2, 3, 4, 0])) == 4


def test_refcounts_with_shared_prefix():
    bm = BlockManager(20, BS)
    prompt = list(range(9))
    a, b = req("a", prompt), req("b", prompt + [50, 51])
    run_prefill(bm, a)
    run_prefill(bm, b)
    shared = bm.block_table("a")[:2]
    assert all(bm.blocks[x].ref_count == 2 for x in shared)
    bm.free(a)
    bm.check_invariants()
    assert all(bm.blocks[x].ref_count == 1 for x in shared)
    assert bm.num_used_blocks == len(bm.block_table("b"))
    bm.free(b)
    bm.free(b)                                          # idempotent
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_freed_block_keeps_hash_and_is_reused_for_a_hit():
    bm = BlockManager(20, BS)
    prompt = list(range(9))
    a = req("a", prompt)
    run_prefill(bm, a)
    a_blocks = list(bm.block_table("a"))
    bm.free(a)
    assert bm.num_free_blocks == bm.num_total_blocks    # evictable blocks count as free
    assert bm.num_cached_blocks == 2
    b = req("b", prompt)
    assert bm.allocate(b, 1) and b.num_computed_tokens == 8
    assert bm.block_table("b")[:2] == a_blocks[:2]
    bm.check_invariants()


def test_reset_prefix_cache_forgets_every_free_published_block():
    bm = BlockManager(20, BS)
    prompt = list(range(9))
    a = req("a", prompt)
    run_prefill(bm, a)
    held = req("held", [40] * 9)
    run_prefill(bm, held)
    before = snapshot(bm, a, held)
    assert not bm.reset_prefix_cache()                  # a request holds blocks: nothing changes
    assert snapshot(bm, a, held) == before
    bm.free(a)                                          # a's blocks are free and cached; held's are not free
    before = snapshot(bm, a, held)
    assert not bm.reset_prefix_cache() and snapshot(bm, a, held) == before
    bm.free(held)
    free = bm.num_free_blocks
    assert bm.num_cached_blocks == 4 and bm.get_num_cached_prefix_tokens(req("b", prompt)) == 8
    assert bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.num_free_blocks == free == bm.num_total_blocks and bm.num_cached_blocks == 0
    assert not bm._free_cached and all(b.hash is None and b.tokens is None for b in bm.blocks)
    b = req("b", prompt)
    assert bm.get_num_cached_prefix_tokens(b) == 0
    assert bm.allocate(b, 9) and b.num_cached_tokens == 0 and b.num_computed_tokens == 0
    bm.check_invariants()
    assert bm.reset_prefix_cache() is False            # b holds blocks
    bm.free(b)
    assert bm.reset_prefix_cache() and bm.reset_prefix_cache()   # nothing cached: still True


def test_eviction_prefers_plain_blocks_then_lru():
    bm = BlockManager(6, BS)                            # 5 usable blocks
    a = req("a", list(range(9)))                        # 3 blocks, 2 published
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 2
    c = req("c", [50] * 3)                               # takes one of the 3 plain blocks
    assert bm.allocate(c, 3)
    assert bm.num_cached_blocks == 2
    d = req("d", [60] * 9)                               # 3 blocks: 2 plain, then evicts one cached
    assert bm.allocate(d, 9)
    assert bm.num_cached_blocks == 1
    # a's tail block was freed first, so it went first; its first block survives.
    assert bm.get_num_cached_prefix_tokens(req("e", list(range(9)))) == 4
    e = req("e2", [70] * 4)
    assert bm.allocate(e, 4) and bm.num_cached_blocks == 0
    assert bm.get_num_cached_prefix_tokens(req("f", list(range(9)))) == 0
    bm.check_invariants()


def test_claiming_evictable_prefix_is_paid_for():
    bm = BlockManager(4, BS)                            # 3 usable
    a = req("a", list(range(9)))
    run_prefill(bm, a)
    bm.free(a)                                          # 2 cached-free + 1 plain-free
    b = req("b", list(range(9)) + [1, 2, 3, 4])         # 13 tokens: hit 8, needs 2 more blocks
    assert not bm.can_allocate(b, 5)
    before = snapshot(bm, b)
    assert not bm.allocate(b, 5)
    assert snapshot(bm, b) == before                    # a failed allocate changes nothing
    c = req("c", list(range(9)))                        # hit 8, needs 1 more: exactly 3
    assert bm.can_allocate(c, 1) and bm.allocate(c, 1)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_scratch_block_never_handed_out():
    bm = BlockManager(5, BS)
    reqs = [req(f"r{i}", [i] * BS) for i in range(10)]
    got = [r for r in reqs if bm.allocate(r, BS)]
    assert len(got) == 4 and bm.num_free_blocks == 0
    held = [b for r in got for b in bm.block_table(r.request_id)]
    assert sorted(held) == [1, 2, 3, 4]
    assert not bm.allocate(reqs[-1], 1)
    bm.check_invariants()
    for r in got:
        bm.free(r)
    assert bm.num_free_blocks == 4
    bm.check_invariants()


def test_placeholder_blocks_are_never_hashed():
    bm = BlockManager(20, BS)
    r = req("a", [1, 2, 3])
    assert bm.allocate(r, 3)
    r.num_computed_tokens = 3
    r.append_output(PLACEHOLDER)                        # token 3, in flight
    assert bm.allocate(r, 1)
    r.num_computed_tokens = 4                            # async: advanced at launch
    bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 0
    r.append_output(PLACEHOLDER)
    r.resolve_placeholder(3, 9)                          # the value arrives
    bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 1
    assert bm.blocks[bm.block_table("a")[0]].tokens == (1, 2, 3, 9)
    assert bm.get_num_cached_prefix_tokens(req("b", [1, 2, 3, 9, 5])) == 4
    assert bm.get_num_cached_prefix_tokens(req("c", [1, 2, 3, PLACEHOLDER, 5])) == 0
    bm.check_invariants()


def test_only_computed_blocks_are_published():
    bm = BlockManager(20, BS)
    r = req("a", list(range(10)))
    assert bm.allocate(r, 5)                            # chunk: 5 of 10 tokens
    r.num_computed_tokens = 5
    bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 1
    assert bm.allocate(r, 5)
    r.num_computed_tokens = 10
    bm.cache_full_blocks(r)
    assert bm.num_cached_blocks == 2
    bm.check_invariants()


def test_duplicate_content_stays_private():
    bm = BlockManager(20, BS)
    a, b = req("a", list(range(9))), req("b", list(range(9)))
    assert bm.allocate(a, 9) and bm.allocate(b, 9)      # both prefill before either publishes
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert bm.num_cached_blocks == 2
    bm.check_invariants()
    bm.free(a)
    bm.free(b)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks


def test_prefix_caching_disabled():
    bm = BlockManager(20, BS, enable_prefix_caching=False)
    run_prefill(bm, req("a", list(range(9))))
    assert bm.num_cached_blocks == 0
    assert bm.get_num_cached_prefix_tokens(req("b", list(range(9)))) == 0


def test_preempted_request_resumes_from_cache_and_keeps_first_hit_count():
    bm = BlockManager(20, BS)
    run_prefill(bm, req("a", list(range(9))))
    b = req("b", list(range(9)))
    assert bm.allocate(b, 1) and b.num_cached_tokens == 8
    b.status = RequestStatus.RUNNING
    b.num_computed_tokens = 9
    for t in (20, 21, 22, 23):                          # decode 4 tokens: 13 tokens, 12 computed
        b.append_output(t)
        assert bm.allocate(b, 1)
        b.num_computed_tokens += 1
        bm.cache_full_blocks(b)
    b.num_computed_tokens = 12
    bm.free(b)                                          # preempted by recompute
    b.num_computed_tokens = 0
    b.status = RequestStatus.PREEMPTED
    assert bm.allocate(b, 1)
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 8
    bm.check_invariants()


def _state(bm):
    return (list(bm._free_plain), list(bm._free_cached), dict(bm._hash_to_block),
            {k: list(v) for k, v in bm._tables.items()}, {k: list(v) for k, v in bm._hashes.items()},
            [(b.ref_count, b.hash, b.parent_hash, b.tokens) for b in bm.blocks])


@pytest.mark.parametrize("custom_hash", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_batched_publishing_matches_per_request(seed, custom_hash):
    """cache_full_blocks_rows (tokens gathered from numpy rows) leaves exactly the state that
    cache_full_blocks per request does: same hashes, same published blocks, same free lists, on
    random growing sequences with shared prefixes, trailing placeholders resolved later, frees and
    re-admissions (prefix hits). With a custom hash_fn the batched path calls it (never on a
    placeholder)."""
    rng = random.Random(seed)
    seen = []

    def checked(parent, tokens):
        assert PLACEHOLDER not in list(tokens)
        seen.append(1)
        return hash_block(parent, tokens)

    kw = {"hash_fn": checked} if custom_hash else {}
    per, bat = BlockManager(200, BS, **kw), BlockManager(200, BS, **kw)
    R, width = 6, 120
    rows = np.zeros((R, width), dtype=np.int64)
    live = {}                                  # row -> (per-request twin, batched twin)
    prefixes = [[rng.randint(0, 5) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    n = 0
    for _ in range(150):
        free_rows = [r for r in range(R) if r not in live]
        if free_rows and rng.random() < 0.3:   # admit (perhaps hitting the cache)
            row = rng.choice(free_rows)
            prompt = rng.choice(prefixes) + [rng.randint(0, 5) for _ in range(rng.randint(1, 9))]
            n += 1
            a, b = req(f"r{n}", prompt, 99), req(f"r{n}", prompt, 99)
            k = len(prompt) - per.get_num_cached_prefix_tokens(a)
            assert per.allocate(a, k) and bat.allocate(b, k)
            assert a.num_computed_tokens == b.num_computed_tokens
            live[row] = (a, b)
        for row, (a, b) in list(live.items()):
            roll = rng.random()
            if roll < 0.1:                     # finish
                per.free(a), bat.free(b)
                del live[row]
                continue
            if roll < 0.5 and a.num_tokens < width - 2:         # compute what is there, append
                new = a.num_tokens - a.num_computed_tokens
                assert per.allocate(a, new + 1) and bat.allocate(b, new + 1)
                for r in (a, b):
                    r.num_computed_tokens += new
                tok = PLACEHOLDER if rng.random() < 0.4 else rng.randint(0, 5)
                a.append_output(tok), b.append_output(tok)
            elif a.num_placeholders:           # resolve the oldest placeholder
                i = a.token_ids.index(PLACEHOLDER)
                tok = rng.randint(0, 5)
                a.resolve_placeholder(i, tok), b.resolve_placeholder(i, tok)
        if not live:
            continue
        order = rng.sample(sorted(live), rng.randint(1, len(live)))
        for row in order:
            a, b = live[row]
            rows[row, :b.num_tokens] = b.token_ids
            per.cache_full_blocks(a)
        bs = np.array(order)
        full = np.array([min(live[r][1].num_computed_tokens, live[r][1].num_tokens) // BS for r in order])
        bat.cache_full_blocks_rows([live[r][1] for r in order], rows, bs, full)
        assert _state(per) == _state(bat)
        per.check_invariants(), bat.check_invariants()
    assert per.num_cached_blocks > 5          # the walk did publish (and so compared) something
    assert not custom_hash or seen


def test_batched_publishing_placeholder_test_has_no_false_alarm():
    """bulk_publish.py tests a block's int64 bytes for a placeholder's eight 0xff bytes: tokens
    whose low seven bytes are 0xff, side by side, must not look like one (and a real placeholder
    must). The published block's tokens read back as the tuple the per-request path stores."""
    big = (1 << 56) - 1                                  # bytes ff ff ff ff ff ff ff 00 (little-endian)
    for held in (False, True):
        bm = BlockManager(20, BS)
        tokens = [big, big, (1 << 62) - 1, PLACEHOLDER if held else big]
        r = req("a", tokens + [1])
        assert bm.allocate(r, 5)
        r.num_computed_tokens = 5
        rows = np.array([tokens + [1, 0, 0, 0]], dtype=np.int64)
        bm.cache_full_blocks_rows([r], rows, np.array([0]), np.array([1]))
        assert bm.num_cached_blocks == (0 if held else 1)
        if not held:
            assert bm.blocks[bm.block_table("a")[0]].tokens == tuple(tokens)
            bm.check_invariants()
