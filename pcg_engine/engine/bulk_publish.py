"""Publishing the blocks that a decode step fills, for many rows of one token array at once.

At batch 256 with 16-token blocks, 16 rows fill a block every decode step. Going through
BlockManager.cache_full_blocks one request at a time re-reads each request's token list, slices
it, scans it for placeholders and packs it into bytes. Here the filled blocks' tokens are gathered
from the rows by one numpy indexing and turned into bytes by one tobytes() (native int64, the
bytes hash_block hashes), so what is left per block is a bytes slice, a placeholder test on it,
the sha256 and the block manager's dict updates. The block keeps those bytes as its tokens
(Block.tokens makes the tuple when read, which only prefix lookups and checks do).

The hashes, the blocks published and the order in which they are published are those of
cache_full_blocks called per request in the same order (tests/core/test_block_manager.py).
"""

from hashlib import sha256
from itertools import repeat

import numpy as np

from pcg_engine.engine.request import PLACEHOLDER

# A placeholder's int64 bytes (all ones). In the int64 bytes of tokens that are non-negative or
# placeholders, eight 0xff bytes in a row mean a placeholder: a run not aligned to a token covers
# the sign byte of one of the two tokens it straddles, which is 0xff only for a negative token.
_HELD = np.array([PLACEHOLDER], dtype=np.int64).tobytes()


def publish_rows(blocks, requests, token_ids: np.ndarray, rows: np.ndarray, num_full: np.ndarray,
                 hash_fn=None) -> None:
    """BlockManager.cache_full_blocks_rows: requests[i] holds its tokens in token_ids[rows[i]]
    (int64) and has num_full[i] full blocks of computed tokens. The decode step's case, exactly one
    block to publish (the last full one), is done here; a request with several waiting goes
    through cache_full_blocks. hash_fn: the block manager's custom hash (called with the token
    list), None for hash_block's sha256 (done inline)."""
    hashes_of, tables, by_id, hash_to_block = blocks._hashes, blocks._tables, blocks.blocks, blocks._hash_to_block
    # Each request's last full block (index -1, any block, where it has none: not read then).
    chunks = blocks_view(blocks, token_ids)[rows, num_full - 1]
    data = chunks.tobytes()
    lists = None if hash_fn is None else chunks.tolist()
    w = chunks.shape[1] * 8
    # `in` would try the bytes as an int first (a TypeError raised and cleared): find. One search
    # of all the blocks first, the usual answer being none.
    held = data.find(_HELD) >= 0
    for request, n, chunk, tokens in zip(requests, num_full.tolist(), [data[a:a + w] for a in range(0, len(data), w)],
                                         repeat(None) if lists is None else lists):
        rid = request.request_id
        hashes = hashes_of.get(rid)
        if hashes is None:
            continue
        table = tables[rid]
        if len(hashes) != n - 1 or n > len(table):
            if len(hashes) < min(n, len(table)):
                blocks.cache_full_blocks(request)        # several blocks wait: the general path
            continue
        if held and chunk.find(_HELD) >= 0:
            continue                                     # published once the placeholder is resolved
        if tokens is not None:
            parent = hashes[-1] if hashes else None
            h = hash_fn(parent, tokens)
        elif hashes:
            parent = hashes[-1]
            h = sha256(parent + chunk).digest()
        else:
            parent = None
            h = sha256(chunk).digest()
        hashes.append(h)
        block = by_id[table[n - 1]]
        # Same content computed twice (or a collision): keep the first copy, leave this one private.
        if block.hash is None and h not in hash_to_block:
            block.hash, block.parent_hash, block._tokens = h, parent, chunk
            hash_to_block[h] = block.block_id


def blocks_view(blocks, token_ids: np.ndarray) -> np.ndarray:
    """token_ids [R, W] (int64) seen as [R, W // block_size, block_size] blocks: a view, kept per array."""
    cached = blocks._blocks_view
    if cached is None or cached[0] is not token_ids:
        if token_ids.dtype != np.int64:
            raise TypeError(f"token_ids: bulk publishing reads int64 rows, got {token_ids.dtype}")
        bs = blocks.block_size
        r, w = token_ids.strides
        view = np.lib.stride_tricks.as_strided(token_ids, (token_ids.shape[0], token_ids.shape[1] // bs, bs),
                                               (r, bs * w, w), writeable=False)
        cached = blocks._blocks_view = (token_ids, view)
    return cached[1]
