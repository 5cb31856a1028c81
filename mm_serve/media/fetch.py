"""Resolve the ``image_url`` (``video_url``) of a chat content part into an RGB Pillow image (sampled
video frames), safely.

Accepted: ``data:image/...;base64,`` (``data:video/...``); ``http(s)://`` under a :class:`MediaPolicy`;
``file://`` under the allowed local media path. Every failure is an ``ImageError`` (400).

DNS rebinding is closed: each hop resolves the host once, checks every address, then
connects to those addresses itself, sending the original ``Host`` and, for https, the
original name as TLS SNI (httpcore ``sni_hostname``), so the certificate is verified
against the name. Known gaps: a pooled https connection to an IP may be reused for
another name on that IP (verified for the first name); via a CONNECT proxy the SNI is
the IP (fails closed); a ``file://`` path is checked, then opened (``O_NOFOLLOW`` on its
last part only), so a concurrent swap of a parent directory could escape the root.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
from PIL import Image

from mm_serve.media.errors import ImageError, InvalidImageURLError
from mm_serve.media.image_loading import decode_data_uri, load_image_bytes
from mm_serve.media.local_file import read_media_file
from mm_serve.media.media_runner import RunCPU
from mm_serve.media.video_loading import (
    Reserve,
    Video,
    VideoError,
    VideoLimits,
    decode_video_data_uri,
    load_video_bytes,
)

Resolver = Callable[[str, int], Awaitable[list[str]]]
"""``(host, port) -> IP address strings``, best first; raises ``MediaFetchError``."""

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_HOST_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}):")


class MediaFetchError(ImageError):
    """Fetch failed or refused: timeout, HTTP status >= 400, too large, too many redirects,
    refused address, domain or local path. Messages never include the payload."""


@dataclass(frozen=True)
class MediaPolicy:
    """Limits for resolving image (or video) URLs; one instance per server and kind, never mutated."""

    max_pixels: int
    """Largest accepted ``width * height`` of a decoded image, in pixels."""
    max_fetch_bytes: int = 20 * 1024 * 1024
    """Largest body fetched (after content decoding) or file read, in bytes."""
    fetch_timeout_s: float = 10.0
    """Overall limit for one URL, in seconds: DNS, every redirect hop and the body."""
    max_redirects: int = 3
    """Most redirects followed for one URL; 0 refuses any redirect."""
    allowed_local_media_path: Path | None = None
    """Directory ``file://`` paths must resolve inside (symlinks followed); None refuses them."""
    allowed_media_domains: tuple[str, ...] = ()
    """Host names (ASCII; punycode for IDNs) allowed with subdomains; empty allows any."""
    allow_private_networks: bool = False
    """Allow loopback, private, link-local and other non-public addresses."""
    kind: str = "image"
    """What is fetched under this policy: ``image`` or ``video`` (errors name it; the Accept header asks for it)."""

    def __post_init__(self) -> None:
        for name, least in (("max_pixels", 1), ("max_fetch_bytes", 1), ("max_redirects", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be > 0, got {self.fetch_timeout_s}")
        for domain in self.allowed_media_domains:
            if not _HOST_NAME.fullmatch(domain.lower()):
                raise ValueError(f"allowed_media_domains entry is not a host name: {domain!r}")


async def load_image_url(
    url: str,
    policy: MediaPolicy,
    client: httpx.AsyncClient | None = None,
    *,
    resolver: Resolver | None = None,
    run: RunCPU = asyncio.to_thread,
) -> Image.Image:
    """Resolve one image URL (data:, http(s)://, file://) to an upright RGB image.

    Args:
        client: reused for http(s) when given (its redirect setting is overridden per
            request); otherwise a private client is created and closed.
        resolver: host lookup; default ``loop.getaddrinfo`` (tests inject a stub).
        run: runs the decoding off the event loop (a call's
            :class:`~mm_serve.media.media_runner.MediaTurns` in the server).

    Raises:
        InvalidImageURLError: unsupported scheme, malformed URL or data URI, bad base64.
        MediaFetchError: fetch failed or refused by ``policy`` (see the class).
        ImageTooLargeError, ImageDecodeError: a bomb; not a supported image, or truncated.
    """
    text = url.strip()
    scheme = _scheme_of(text)
    if scheme == "data":
        return await run(functools.partial(decode_data_uri, text, max_pixels=policy.max_pixels))
    if scheme in ("http", "https"):
        if client is None:  # load_image_urls opens, uses and closes a private client
            return (await load_image_urls([text], policy, resolver=resolver, run=run))[0]
        data = await _fetch(text, policy, client, resolver or _resolve)
    elif scheme == "file":
        data = await asyncio.to_thread(_read_local_file, text, policy)
    else:
        shown = f"scheme {scheme!r}" if scheme else "no scheme"
        raise InvalidImageURLError(
            f"unsupported image URL ({shown}): expected data:image/<format>;base64,..., "
            "http(s)://, or file:// under the server's allowed local media path"
        )
    return await run(functools.partial(load_image_bytes, data, max_pixels=policy.max_pixels))


async def load_video_url(
    url: str,
    policy: MediaPolicy,
    limits: VideoLimits,
    client: httpx.AsyncClient | None = None,
    *,
    resolver: Resolver | None = None,
    reserve: Reserve | None = None,
    run: RunCPU = asyncio.to_thread,
) -> Video:
    """Resolve one video URL (``data:video/...``, http(s)://, file://) to frames sampled under ``limits``
    (:func:`~mm_serve.media.video_loading.load_video_bytes`, which gives ``reserve`` the bytes its decoding
    will hold), fetched under ``policy`` (its ``kind`` ``video``) as images are.

    Raises:
        VideoError: unsupported scheme, a bad data URI, not a video, a limit of ``limits`` passed, or the
            fetch failed or was refused by ``policy`` (what :class:`MediaFetchError` says of an image).
    """
    text = url.strip()
    scheme = _scheme_of(text)
    if scheme == "data":
        return await run(decode_video_data_uri, text, limits, reserve)
    if scheme in ("http", "https"):
        if client is None:
            loaded = await load_media_urls([(text, limits)], policy, policy, resolver=resolver, reserve=reserve,
                                           run=run)
            assert isinstance(loaded[0], Video)
            return loaded[0]
        try:
            data = await _fetch(text, policy, client, resolver or _resolve)
        except ImageError as exc:
            raise VideoError(str(exc)) from None
    elif scheme == "file":
        try:
            data = await asyncio.to_thread(_read_local_file, text, policy)
        except ImageError as exc:
            raise VideoError(str(exc)) from None
    else:
        shown = f"scheme {scheme!r}" if scheme else "no scheme"
        raise VideoError(f"unsupported video URL ({shown}): expected data:video/<format>;base64,..., http(s)://, "
                         "or file:// under the server's allowed local media path")
    return await run(load_video_bytes, data, limits, reserve)


async def load_image_urls(
    urls: list[str],
    policy: MediaPolicy,
    client: httpx.AsyncClient | None = None,
    *,
    resolver: Resolver | None = None,
    run: RunCPU = asyncio.to_thread,
) -> list[Image.Image]:
    """Resolve image URLs concurrently, in order, sharing one http client (as ``load_image_url``).

    On the first error (in time) the other loads are cancelled and awaited, then it is raised.
    """
    loaded = await load_media_urls([(u, None) for u in urls], policy, policy, client, resolver=resolver, run=run)
    return [image for image in loaded if isinstance(image, Image.Image)]


async def load_media_urls(
    items: Sequence[tuple[str, VideoLimits | None]],
    policy: MediaPolicy,
    video_policy: MediaPolicy,
    client: httpx.AsyncClient | None = None,
    *,
    resolver: Resolver | None = None,
    reserve: Reserve | None = None,
    run: RunCPU = asyncio.to_thread,
) -> list[Image.Image | Video]:
    """Resolve image and video URLs concurrently, in order, sharing one http client: ``(url, None)`` an
    image under ``policy`` (:func:`load_image_url`), ``(url, limits)`` a video under ``video_policy``
    (:func:`load_video_url`, with ``reserve``); ``run`` runs their decoding off the event loop.

    On the first error (in time) the other loads are cancelled and awaited, then it is raised.
    """
    if client is None and any(_scheme_of(u.strip()) in ("http", "https") for u, _ in items):
        # A private client ignores proxies and .netrc from the environment.
        timeout = max(policy.fetch_timeout_s, video_policy.fetch_timeout_s)
        async with httpx.AsyncClient(trust_env=False, timeout=timeout) as own_client:
            return await load_media_urls(items, policy, video_policy, own_client, resolver=resolver, reserve=reserve,
                                         run=run)
    loads = (load_image_url(u, policy, client, resolver=resolver, run=run) if limits is None
             else load_video_url(u, video_policy, limits, client, resolver=resolver, reserve=reserve, run=run)
             for u, limits in items)
    tasks: list[asyncio.Future[Image.Image | Video]] = [asyncio.ensure_future(load) for load in loads]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)  # let them unwind before the shared client closes
        raise


def _scheme_of(text: str) -> str:
    """The lower-cased URL scheme, or "" when ``text`` does not start with one."""
    match = _SCHEME.match(text)
    return match.group(1).lower() if match else ""


async def _fetch(
    url: str, policy: MediaPolicy, client: httpx.AsyncClient, resolve: Resolver
) -> bytes:
    """Fetch an http(s) URL within ``policy.fetch_timeout_s`` overall; map httpx errors."""
    try:
        return await asyncio.wait_for(_follow(url, policy, client, resolve), policy.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise MediaFetchError(f"{policy.kind} fetch timed out after {policy.fetch_timeout_s:g} s") from None
    except httpx.InvalidURL as exc:
        raise InvalidImageURLError(f"{policy.kind} URL is malformed") from exc
    except httpx.HTTPError as exc:
        raise MediaFetchError(f"could not fetch the image: {_shorten(repr(exc))}") from exc


async def _follow(
    url: str, policy: MediaPolicy, client: httpx.AsyncClient, resolve: Resolver
) -> bytes:
    """GET ``url``, following at most ``policy.max_redirects`` redirects, each hop re-checked."""
    target = httpx.URL(url)
    for _ in range(policy.max_redirects + 1):
        addresses = await _checked_addresses(target, policy, resolve)
        response = await _send(client, target, addresses, policy.fetch_timeout_s, f"{policy.kind}/*")
        try:
            location = response.headers.get("location")
            if response.status_code in (301, 302, 303, 307, 308) and location:
                target = target.join(location)  # relative to the name, not the pinned IP
                if target.scheme not in ("http", "https"):
                    raise MediaFetchError(f"{policy.kind} URL redirected to a non-http(s) URL; refused")
                continue
            if not 200 <= response.status_code < 300:
                status = f"{response.status_code} {_shorten(response.reason_phrase)}".rstrip()
                raise MediaFetchError(f"{policy.kind} URL returned HTTP {status}")
            return await _read_capped(response, policy.max_fetch_bytes, policy.kind)
        finally:
            await response.aclose()
    raise MediaFetchError(f"{policy.kind} URL redirected more than {policy.max_redirects} times")


async def _send(
    client: httpx.AsyncClient, url: httpx.URL, addresses: list[str], timeout_s: float, accept: str = "image/*"
) -> httpx.Response:
    """Send a streamed GET for ``url`` to each checked address in turn until one connects."""
    host = url.raw_host.decode("ascii").strip("[]")
    headers = {"Host": url.netloc.decode("ascii"), "Accept": accept}
    extensions = {"sni_hostname": host} if url.scheme == "https" else {}

    def request_to(address: str) -> httpx.Request:
        pinned = url.copy_with(host=address)
        return client.build_request(
            "GET", pinned, headers=headers, extensions=extensions, timeout=timeout_s
        )

    *others, last = addresses
    for address in others:
        try:
            return await client.send(request_to(address), stream=True, follow_redirects=False)
        except httpx.ConnectError:
            continue  # as httpx itself would for a name: try the next address
    return await client.send(request_to(last), stream=True, follow_redirects=False)


async def _checked_addresses(url: httpx.URL, policy: MediaPolicy, resolve: Resolver) -> list[str]:
    """``url``'s addresses, best first, once the domain and every address pass the policy.

    Raises MediaFetchError (domain, no address, non-public address), InvalidImageURLError.
    """
    host = url.raw_host.decode("ascii").strip("[]")
    if not host:
        raise InvalidImageURLError(f"{policy.kind} URL has no host")
    name = host.rstrip(".").lower()
    shown = repr(_shorten(name))
    domains = [d.lower() for d in policy.allowed_media_domains]
    if domains and not any(name == d or name.endswith("." + d) for d in domains):
        raise MediaFetchError(f"{policy.kind} host {shown} is not in the allowed media domains")
    resolved = await resolve(host, url.port or (443 if url.scheme == "https" else 80))
    addresses = [address.partition("%")[0] for address in resolved]  # drop IPv6 scope ids
    if not addresses:
        raise MediaFetchError(f"{policy.kind} host {shown} did not resolve to any address")
    if not policy.allow_private_networks:
        if not all(_is_public(ipaddress.ip_address(address)) for address in addresses):
            raise MediaFetchError(f"{policy.kind} host {shown} resolves to a non-public address")
    return addresses


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """True for globally routable unicast addresses; IPv4 embedded in IPv6 is judged as IPv4."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return _is_public(embedded)
        if ip.is_site_local:
            return False
    refused = ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
    return ip.is_global and not (refused or ip.is_reserved or ip.is_unspecified)


async def _resolve(host: str, port: int) -> list[str]:
    """Default :data:`Resolver`: the event loop's ``getaddrinfo`` (TCP), duplicates removed."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise MediaFetchError(f"cannot resolve host {_shorten(host)!r}") from exc
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def _read_capped(response: httpx.Response, max_bytes: int, kind: str = "image") -> bytes:
    """Read the body, refusing early on Content-Length and as soon as ``max_bytes`` is passed."""
    declared = response.headers.get("content-length", "").strip()
    if declared.isdigit() and (len(declared) > 18 or int(declared) > max_bytes):
        raise MediaFetchError(f"{kind} is larger than the {max_bytes}-byte limit (Content-Length)")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise MediaFetchError(f"{kind} is larger than the {max_bytes}-byte limit")
    return bytes(body)


def _read_local_file(url: str, policy: MediaPolicy) -> bytes:
    """Read a ``file://`` URL whose real path (``..``, symlinks resolved) is inside
    ``policy.allowed_local_media_path``; otherwise, or if unreadable, MediaFetchError."""
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaFetchError(f"file:// {policy.kind} URLs are disabled on this server")
    parts = urlsplit(url)
    path = unquote(parts.path)
    if parts.netloc not in ("", "localhost") or not path.startswith("/") or "\x00" in path:
        raise MediaFetchError(f"file:// {policy.kind} URL must be file:///<absolute path> on this host")
    cap = policy.max_fetch_bytes
    try:
        resolved = Path(path).resolve()
        if not resolved.is_relative_to(root.resolve()):
            raise MediaFetchError(f"file:// {policy.kind} path is outside the allowed media directory")
        return read_media_file(resolved, cap, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise MediaFetchError(f"file:// {policy.kind} is not a regular file") from exc
        if exc.errno == errno.EFBIG:
            raise MediaFetchError(f"{policy.kind} file is larger than the {cap}-byte limit") from exc
        raise MediaFetchError(f"file:// {policy.kind} does not exist or cannot be read") from exc
    except RuntimeError as exc:  # a symlink loop
        raise MediaFetchError(f"file:// {policy.kind} does not exist or cannot be read") from exc


def _shorten(text: str) -> str:
    """``text`` cut to at most 80 characters, fit for an error message."""
    return text if len(text) <= 80 else text[:77] + "..."
