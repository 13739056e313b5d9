"""Chained hashes of full KV blocks, the keys of the prefix cache.

A block's KV depends on every token before it, not only its own, so its key
chains the previous block's key with this block's token ids: two blocks share
a key only when their whole prefixes agree (up to a 64-bit hash collision,
which the block manager guards against by also comparing the block's tokens).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike

NO_PARENT = -1


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The key of a full block whose predecessor's key is ``parent``
    (``NO_PARENT`` for the first block)."""
    return hash((parent, tokens))


def chain_root(variant: int) -> int:
    """The parent key of a first block. Sequences whose KV differs for the same
    tokens (longrope's short and long rotations) chain from different roots, so
    their blocks never share a key; variant 0 is ``NO_PARENT``."""
    return NO_PARENT if variant == 0 else hash((NO_PARENT, "variant", variant))


def block_tokens(token_ids: SequenceLike[int], index: int, block_size: int) -> tuple[int, ...]:
    """The token ids of block ``index`` of a token stream."""
    start = index * block_size
    return tuple(token_ids[start:start + block_size])


def extend_chain(hashes: list[int], token_ids: SequenceLike[int], num_full_blocks: int,
                 block_size: int, root: int = NO_PARENT) -> None:
    """Append the keys of blocks ``len(hashes) .. num_full_blocks - 1`` to ``hashes``
    (``root``: the first block's parent, ``chain_root``)."""
    for index in range(len(hashes), num_full_blocks):
        parent = hashes[-1] if hashes else root
        hashes.append(block_hash(parent, block_tokens(token_ids, index, block_size)))
