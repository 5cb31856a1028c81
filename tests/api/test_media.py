"""Tests for mm_serve.media.fetch: data URIs, http(s) under a MediaPolicy, file:// URLs."""

from __future__ import annotations

import asyncio
import base64
import io
import random
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from PIL import Image

from mm_serve.media import errors
from mm_serve.media.fetch import MediaFetchError, MediaPolicy, load_image_url, load_image_urls

RED, BLUE = (255, 0, 0), (0, 0, 255)
POLICY = MediaPolicy(max_pixels=1_000_000)
LOCAL = MediaPolicy(max_pixels=1_000_000, allow_private_networks=True, fetch_timeout_s=2.0)
PUBLIC_IP = "93.184.215.14"


def encode(image: Image.Image, fmt: str = "PNG", **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb(width: int, height: int) -> bytes:
    """A small PNG whose IHDR (CRC fixed up) declares width x height: a decompression bomb."""
    png = bytearray(RED_PNG)
    png[16:24] = struct.pack(">II", width, height)
    png[29:33] = struct.pack(">I", zlib.crc32(png[12:29]))
    return bytes(png)


RED_PNG, BLUE_PNG = (encode(Image.new("RGB", (8, 6), colour)) for colour in (RED, BLUE))
NOISE_PNG = encode(Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3)))


def load(url: str, policy: MediaPolicy = POLICY) -> Image.Image:
    return asyncio.run(load_image_url(url, policy))


def assert_colour(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 0) -> None:
    pixel = image.getpixel((image.width // 2, image.height // 2))
    assert image.mode == "RGB" and isinstance(pixel, tuple), (image.mode, pixel)
    assert all(abs(a - b) <= tolerance for a, b in zip(pixel, colour, strict=True)), pixel


@pytest.mark.parametrize("fmt, tol", [("PNG", 0), ("JPEG", 6), ("WEBP", 6), ("GIF", 0), ("BMP", 0)])
def test_data_uri_formats_decode(fmt: str, tol: int) -> None:
    blue = [Image.new("RGB", (8, 6), BLUE)]  # a second frame where the format has frames
    frames = {"save_all": True, "append_images": blue} if fmt in ("PNG", "WEBP", "GIF") else {}
    data = encode(Image.new("RGB", (8, 6), (200, 40, 30)), fmt, **frames)
    image = load(data_uri(data, f"image/{fmt.lower()}"))
    assert image.size == (8, 6)
    assert_colour(image, (200, 40, 30), tol)


@pytest.mark.parametrize(
    "uri, error",
    [
        ("data:image/png;base64,!!not-base64!!" + "A" * 100_000, errors.InvalidImageURLError),
        (data_uri(RED_PNG, "text/plain"), errors.InvalidImageURLError),
        (data_uri(bytes(range(256)) * 8), errors.ImageDecodeError),
        (data_uri(NOISE_PNG[: len(NOISE_PNG) // 2]), errors.ImageDecodeError),
        (data_uri(bomb(2000, 2000)), errors.ImageTooLargeError),
        (data_uri(bomb(100_000, 100_000)), errors.ImageTooLargeError),
        *[(url, errors.InvalidImageURLError) for url in ("ftp://h/a.png", "javascript:alert(1)")],
        *[(url, errors.InvalidImageURLError) for url in ("/etc/passwd", "", " ")],
    ],
    ids=["bad-base64", "text-type", "random-bytes", "truncated-png", "bomb", "huge-bomb", "ftp",
         "javascript", "plain-path", "empty", "blank"],
)
def test_bad_urls_raise_the_right_error(uri: str, error: type[errors.ImageError]) -> None:
    with pytest.raises(error) as info:
        load(uri)
    assert len(str(info.value)) < 300 and "alert" not in str(info.value)  # no payload echoed


def test_policy_rejects_bad_values() -> None:
    for field, bad in [("max_pixels", 0), ("max_fetch_bytes", 0), ("fetch_timeout_s", 0),
                       ("max_redirects", -1), ("allowed_media_domains", ("https://a.org",))]:
        with pytest.raises(ValueError, match=field):
            MediaPolicy(**{"max_pixels": 10, field: bad})  # type: ignore[arg-type]


@dataclass
class Reply:
    """What the local site sends for one path: 302 to ``location`` if set, else 200 and body."""

    body: bytes = b""
    repeat_every_s: float | None = None  # resend body at this pace, with no Content-Length
    location: str | None = None


class Site(ThreadingHTTPServer):
    """A real HTTP/1.0 server on 127.0.0.1, port 0; ``routes`` maps a path to its Reply."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes = {
            "/red.png": Reply(RED_PNG), "/blue.png": Reply(BLUE_PNG), "/big.png": Reply(NOISE_PNG),
            "/endless": Reply(b"\0" * 4096, repeat_every_s=0.001),
            "/slow": Reply(b"x", repeat_every_s=0.05),  # never idle long enough for a read timeout
            "/r3": Reply(location=self.url("/r2", "localhost")),  # absolute, to another name
            "/r2": Reply(location="/r1"), "/r1": Reply(location="red.png"),
        }
        self.hosts: list[str] = []  # the Host header of every request, in order
        self.stop = threading.Event()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server_address[1]}{path}"


class Handler(BaseHTTPRequestHandler):
    server: Site

    def do_GET(self) -> None:
        self.server.hosts.append(self.headers.get("Host", ""))
        reply = self.server.routes.get(self.path)
        try:
            if reply is None:
                return self.send_error(404)
            self.send_response(302 if reply.location else 200)
            if reply.location:
                self.send_header("Location", reply.location)
            if not reply.repeat_every_s:
                self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)  # unbuffered: each write is sent at once
            for _ in range(int(5 / reply.repeat_every_s) if reply.repeat_every_s else 0):
                if self.server.stop.wait(reply.repeat_every_s):  # for ~5 s at most: fail, not hang
                    break
                self.wfile.write(reply.body)
        except OSError:
            pass  # the client gave up, as the tests intend


@pytest.fixture
def site() -> Iterator[Site]:
    server = Site()
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.stop.set()
    server.shutdown()
    server.server_close()


def test_http_fetch_allowed_only_with_private_networks(site: Site) -> None:
    with pytest.raises(MediaFetchError, match="non-public address"):
        load(site.url("/red.png"))  # loopback
    assert site.hosts == []  # refused before connecting
    assert_colour(load(site.url("/red.png"), LOCAL), RED)
    assert site.hosts == [site.url("").removeprefix("http://")]

    async def resolve(host: str, port: int) -> list[str]:
        return ["::1", "127.0.0.1"]  # nothing listens on [::1]:port: try the next address
    url = site.url("/red.png", "img.test")
    assert_colour(asyncio.run(load_image_url(url, LOCAL, resolver=resolve)), RED)
    assert site.hosts[-1] == site.url("", "img.test").removeprefix("http://")


CAPPED = MediaPolicy(10_000, max_fetch_bytes=10_000, allow_private_networks=True)
QUICK = MediaPolicy(100, fetch_timeout_s=0.5, allow_private_networks=True)
TWO_HOPS = MediaPolicy(100, max_redirects=2, allow_private_networks=True)


@pytest.mark.parametrize(
    "path, policy, match",
    [("/r3", LOCAL, None), ("/r3", TWO_HOPS, "redirected more than 2 times"),
     ("/big.png", CAPPED, r"10000-byte limit \(Content-Length\)"),
     ("/endless", CAPPED, "10000-byte limit$"), ("/slow", QUICK, "timed out after 0.5 s"),
     ("/missing.png", LOCAL, "HTTP 404 Not Found")],
)
def test_fetch_limits(site: Site, path: str, policy: MediaPolicy, match: str | None) -> None:
    started = time.monotonic()
    if match is None:  # three redirects, the default limit
        assert_colour(load(site.url(path), policy), RED)
        assert site.hosts[1:] == [site.url("", "localhost")[7:]] * 3  # names survive IP pinning
    else:
        with pytest.raises(MediaFetchError, match=match):
            load(site.url(path), policy)
    assert time.monotonic() - started < 1.5  # the slow one stops at its 0.5 s timeout


def test_load_image_urls_keeps_order_and_cancels_on_error(site: Site) -> None:
    urls = [data_uri(RED_PNG), site.url("/blue.png"), data_uri(RED_PNG)]
    images = asyncio.run(load_image_urls(urls, LOCAL))
    assert [image.getpixel((0, 0)) for image in images] == [RED, BLUE, RED]
    started = time.monotonic()
    with pytest.raises(errors.InvalidImageURLError):
        asyncio.run(load_image_urls([site.url("/slow"), "ftp://h/x.png"], LOCAL))
    assert time.monotonic() - started < 1.0  # the slow fetch was cancelled, not awaited


PUBLIC_NAMES = ("img.example.com", "example.com", "badexample.com", "example.com.evil.net", "b.org")
PRIVATE_NAMES = {"internal.example.com": ["10.0.0.7"], "dual.example.com": [PUBLIC_IP, "fd00::1"]}
REDIRECTS = {"/to-internal": "http://internal.example.com/red.png", "/to-file": "file:///etc/x",
             "/to-loopback": "http://127.0.0.1/red.png", "/to-other": "https://b.org/red.png"}


def addresses_of(host: str) -> list[str]:
    """PUBLIC_NAMES resolve to PUBLIC_IP, PRIVATE_NAMES as listed, an IP literal to itself."""
    name = host.rstrip(".").lower()
    return [PUBLIC_IP] if name in PUBLIC_NAMES else PRIVATE_NAMES.get(name, [host])


async def stub_resolve(host: str, port: int) -> list[str]:
    return addresses_of(host)


def load_public(url: str, seen: list[httpx.Request], policy: MediaPolicy = POLICY) -> Image.Image:
    """Load through an httpx.MockTransport that stands in for public hosts; log to ``seen``."""
    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path in REDIRECTS:
            return httpx.Response(302, headers={"Location": REDIRECTS[request.url.path]})
        return httpx.Response(200 if request.url.path == "/red.png" else 404, content=RED_PNG)

    async def run() -> Image.Image:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            return await load_image_url(url, policy, client, resolver=stub_resolve)

    return asyncio.run(run())


NON_PUBLIC = """127.0.0.1 10.1.2.3 172.16.0.1 192.168.1.1 169.254.169.254 0.0.0.0 100.64.0.1
224.0.0.1 240.0.0.1 [::1] [::] [fe80::1] [fc00::1] [fec0::1] [ff02::1] [2001:db8::1]
[::ffff:127.0.0.1] [::ffff:10.0.0.1] [2002:7f00:1::] [64:ff9b::a00:1]""".split()
EXAMPLE_ONLY = ("example.com",)


@pytest.mark.parametrize(
    "url, domains, error",
    [(f"http://{address}/red.png", (), "non-public address") for address in NON_PUBLIC]
    + [(f"http://{address}/red.png", (), None) for address in
       (PUBLIC_IP, "[2606:4700::1111]", f"[::ffff:{PUBLIC_IP}]", "[64:ff9b::5db8:d70e]")]
    + [
        ("http://img.example.com/to-internal", (), "non-public address"),
        ("http://img.example.com/to-loopback", (), "non-public address"),
        ("http://img.example.com/to-file", (), "non-http"),
        ("http://dual.example.com/red.png", (), "non-public address"),  # one bad answer is enough
        ("https://img.example.com/red.png", (), None),
        ("https://example.com/red.png", EXAMPLE_ONLY, None),
        ("https://IMG.Example.com./red.png", EXAMPLE_ONLY, None),
        ("https://badexample.com/red.png", EXAMPLE_ONLY, "not in the allowed media domains"),
        ("https://example.com.evil.net/red.png", EXAMPLE_ONLY, "not in the allowed media domains"),
        ("https://img.example.com/to-other", EXAMPLE_ONLY, "not in the allowed media domains"),
    ],
)
def test_public_host_checks(url: str, domains: tuple[str, ...], error: str | None) -> None:
    seen: list[httpx.Request] = []
    policy = MediaPolicy(100, allowed_media_domains=domains)
    if error is None:  # sent to the checked IP, with the name as Host and TLS SNI
        assert_colour(load_public(url, seen, policy), RED)
        name, netloc = httpx.URL(url).host, httpx.URL(url).netloc.decode()
        assert [(r.url.host, r.headers["host"]) for r in seen] == [(addresses_of(name)[0], netloc)]
        assert seen[0].extensions.get("sni_hostname") == (name if url[4] == "s" else None)
    else:
        with pytest.raises(MediaFetchError, match=error):
            load_public(url, seen, policy)
        assert len(seen) == url.count("/to-")  # only a first, allowed hop was ever sent


@pytest.mark.parametrize(
    "url, match",
    [("file://{root}/red.png", None), ("file://localhost{root}/alias.png", None),
     ("file://{root}/../secret.png", "outside"), ("file://{root}/%2E%2E/secret.png", "outside"),
     ("file://{root}/escape.png", "outside"), ("file://{root}/missing.png", "does not exist"),
     ("file://{root}/", "not a regular file"), ("file://otherhost{root}/red.png", "on this host"),
     ("file://{root}/red.png", "10-byte limit"), ("file://{root}/red.png", "disabled")],
)
def test_file_urls(tmp_path: Path, url: str, match: str | None) -> None:
    media = tmp_path / "media"
    media.mkdir()
    (media / "red.png").write_bytes(RED_PNG)
    (tmp_path / "secret.png").write_bytes(BLUE_PNG)
    (media / "escape.png").symlink_to(tmp_path / "secret.png")
    (media / "alias.png").symlink_to(media / "red.png")
    cap, root = 10 if "limit" in str(match) else 10_000, None if match == "disabled" else media
    policy = MediaPolicy(100, cap, allowed_local_media_path=root)
    if match is None:
        assert_colour(load(url.format(root=media), policy), RED)
    else:
        with pytest.raises(MediaFetchError, match=match):
            load(url.format(root=media), policy)
