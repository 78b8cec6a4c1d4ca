"""Keys of the prefix cache: a full page is named by the hash of its tokens and of every token
before it (a chain), so two sequences share a page only if they agree on everything up to its end.
blake2b, not Python's hash: prompts come from users, and a collision would hand one request another
request's K/V."""

from __future__ import annotations

import hashlib
from array import array


def extend_page_hashes(
    hashes: list[bytes], tokens: list[int], page_size: int, full_pages: int
) -> list[bytes]:
    """`hashes` (the chain of the first len(hashes) pages of `tokens`) grown to `full_pages` pages,
    in place; tokens only ever grow, so a sequence computes each page's key once."""
    for p in range(len(hashes), full_pages):
        h = hashlib.blake2b(hashes[-1] if hashes else b"", digest_size=16)
        h.update(array("q", tokens[p * page_size : (p + 1) * page_size]).tobytes())
        hashes.append(h.digest())
    return hashes
