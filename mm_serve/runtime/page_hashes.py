"""Content hashes of images and of full KV pages, for prefix caching and the encoder cache.

A full page's hash chains (vLLM's automatic prefix caching; STYLE.md pattern 11):

    h_p = BLAKE2b-256(h_{p-1} || token ids of page p || content hash of every image whose
                      image tokens overlap page p)

with ``h_{-1}`` = BLAKE2b-256 of a salt naming whatever else changes KV (the model and
its dtype), hashed again with a request's ``cache_salt`` when it has one (:func:`salted`). Two prompts share page ``p`` only if every token *and every image* up to and
including page ``p`` is the same, so identical text around different images never shares
KV. Every hash is the full 256-bit digest (a hash folded to 30 bits collides after ~46 k
images; 256 bits never in practice).

An image's content hash covers what reaches the vision tower: the preprocessed pixel
tensor (its shape, dtype and bytes), so the same picture sent as PNG or as JPEG of other
pixels never matches, and the same pixels sent twice always do.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

import torch

HASH_BYTES = 32  # BLAKE2b digest size: 256 bits


def _blake(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def _int64_le(values: Sequence[int]) -> bytes:
    """``values`` as little-endian int64 bytes (the same on every node of a cluster)."""
    packed = array("q", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def image_content_hash(pixels: torch.Tensor, size: Sequence[int] | None = None, second_per_grid: float = 0.0) -> bytes:
    """Hash of one preprocessed image, ``[3, H, W]`` or its tiles ``[T, 3, H, W]`` (any dtype): shape,
    dtype and bytes, its original ``size`` (height, width) or patch grid when its features depend on it,
    and a video's seconds per temporal patch (its KV's positions depend on it)."""
    t = pixels.detach().contiguous().cpu()
    head = f"{tuple(t.shape)}|{t.dtype}" + ("" if size is None else f"|{tuple(int(v) for v in size)}")
    head += f"|{float(second_per_grid)!r}" if second_per_grid else ""
    return _blake(head.encode(), t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def split_tiles(pixel_values: torch.Tensor, tiles: Sequence[int] = ()) -> list[torch.Tensor]:
    """Each image's pixels from ``pixel_values`` ``[sum(tiles), 3, H, W]``: ``[tiles[i], 3, H, W]``
    each (no ``tiles``: every image is one ``[3, H, W]`` row)."""
    if not tiles:
        return list(pixel_values)
    return list(torch.split(pixel_values, list(tiles), dim=0))


def image_content_hashes(pixel_values: torch.Tensor | None, tiles: Sequence[int] = (),
                         sizes: Sequence[Sequence[int]] = (), second_per_grid: Sequence[float] = ()) -> list[bytes]:
    """:func:`image_content_hash` of each image of ``pixel_values`` (:func:`split_tiles`), with its
    original size when ``sizes`` are given and its seconds per temporal patch when ``second_per_grid`` are
    (None: ``[]``)."""
    if pixel_values is None:
        return []
    images = split_tiles(pixel_values, tiles)
    return [image_content_hash(p, sizes[i] if sizes else None, second_per_grid[i] if second_per_grid else 0.0)
            for i, p in enumerate(images)]


def cache_salt(*parts: str) -> bytes:
    """The root of every chain: a hash of what else changes KV (e.g. model path, dtype)."""
    return _blake("|".join(parts).encode())


def request_salt(text: str | None, tenant: str = "") -> bytes:
    """A request's ``cache_salt`` (vLLM's field; any string) and its ``tenant`` (with
    ``api.cache_salt_by_api_key``, the API key it came with; "" for none) as the bytes :func:`salted`
    takes: their hash, b"" when it has neither. Each part is length-prefixed, so no two different
    pairs hash alike."""
    if text is None and not tenant:
        return b""
    parts = [part.encode("utf-8", "surrogatepass") for part in (tenant, text or "")]
    return _blake(b"cache_salt|", *(len(part).to_bytes(8, "little") + part for part in parts),
                  b"" if text is None else b"|salted")


def salted(digest: bytes, salt: bytes) -> bytes:
    """``digest`` (a chain's root, an image's content hash) made private to requests of ``salt`` (b"": as it is).

    Requests of different salts then share no KV page (every chain starts from a different root) and no
    encoder-cache entry (every image hashes differently), so neither a ``cached_tokens`` count nor a TTFT
    can tell one tenant what another sent (vLLM's ``cache_salt``, its prefix-caching design's multi-tenant
    isolation)."""
    return _blake(digest, salt) if salt else digest


def image_spans(
    token_ids: Sequence[int], image_token_id: int | Sequence[int] | None, token_counts: Sequence[int],
) -> list[tuple[int, int]]:
    """Each image's token positions ``[first, last + 1)`` in ``token_ids``.

    Image ``i`` owns the ``token_counts[i]`` placeholders that follow those of the images before it,
    in order of position (each image carries its own count: families whose images make different
    numbers of tokens); later placeholders (a generated token equal to the image token id, in a
    recompute) are text, as in ``ModelRunner._image_rows``. ``image_token_id`` may be several ids (the
    image and video placeholders of a family that takes videos).
    """
    if not token_counts or image_token_id is None:
        return []
    ids = {image_token_id} if isinstance(image_token_id, int) else set(image_token_id)
    positions = [i for i, t in enumerate(token_ids) if t in ids][: sum(token_counts)]
    spans = []
    start = 0
    for count in token_counts:
        own = positions[start : start + count]
        start += count
        if own:
            spans.append((own[0], own[-1] + 1))
    return spans


def page_hash_chain(
    token_ids: Sequence[int], page_size: int, salt: bytes, image_hashes: Sequence[bytes] = (),
    spans: Sequence[tuple[int, int]] = (), start: Sequence[bytes] = (),
) -> list[bytes]:
    """The chained hashes of every *full* page of ``token_ids`` (``len // page_size`` of them).

    ``spans[i]`` are image ``i``'s positions (:func:`image_spans`) and ``image_hashes[i]`` its
    content hash. ``start``: hashes already computed for the first pages of the same
    sequence (they are kept, and the chain continues from the last of them).

    Raises:
        ValueError: ``spans`` and ``image_hashes`` differ in length.
    """
    if len(spans) != len(image_hashes):
        raise ValueError(f"{len(spans)} image spans but {len(image_hashes)} image hashes")
    chain = list(start)
    parent = chain[-1] if chain else salt
    for page in range(len(chain), len(token_ids) // page_size):
        lo, hi = page * page_size, (page + 1) * page_size
        tokens = _int64_le(token_ids[lo:hi])
        images = b"".join(h for (a, b), h in zip(spans, image_hashes, strict=True) if a < hi and b > lo)
        parent = _blake(parent, tokens, images)
        chain.append(parent)
    return chain
