"""Tests for mm_serve.api.media: data URIs, http(s) under a MediaPolicy, file:// URLs."""

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
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from PIL import Image

from mm_serve.api.media import MediaFetchError, MediaPolicy, load_image_url, load_image_urls
from vision_prefill.errors import (
    ImageDecodeError,
    ImageError,
    ImageTooLargeError,
    InvalidImageURLError,
)

RED, BLUE, GREEN = (255, 0, 0), (0, 0, 255), (0, 255, 0)
POLICY = MediaPolicy(max_pixels=1_000_000)
LOCAL = MediaPolicy(max_pixels=1_000_000, allow_private_networks=True, fetch_timeout_s=2.0)
PUBLIC_IP = "93.184.215.14"


def encode(image: Image.Image, fmt: str = "PNG", **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def solid(colour: tuple[int, int, int], fmt: str = "PNG") -> bytes:
    return encode(Image.new("RGB", (8, 6), colour), fmt)


def data_uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG declaring width x height with an empty IDAT: a decompression bomb's header."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + ihdr + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


NOISE_PNG = encode(Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3)))


def load(url: str, policy: MediaPolicy = POLICY) -> Image.Image:
    return asyncio.run(load_image_url(url, policy))


def assert_colour(image: Image.Image, colour: tuple[int, int, int], tolerance: int = 0) -> None:
    assert image.mode == "RGB"
    pixel = image.getpixel((image.width // 2, image.height // 2))
    assert all(abs(a - b) <= tolerance for a, b in zip(pixel, colour, strict=True)), pixel


@pytest.mark.parametrize("fmt, tol", [("PNG", 0), ("JPEG", 6), ("WEBP", 6), ("GIF", 0), ("BMP", 0)])
def test_data_uri_formats_decode(fmt: str, tol: int) -> None:
    image = load(data_uri(solid((200, 40, 30), fmt), f"image/{fmt.lower()}"))
    assert image.size == (8, 6)
    assert_colour(image, (200, 40, 30), tol)


def test_animated_gif_gives_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), colour) for colour in (RED, BLUE)]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    assert_colour(load(data_uri(gif, "image/gif")), RED)


@pytest.mark.parametrize(
    "uri, error",
    [
        ("data:image/png;base64,!!not-base64!!" + "A" * 100_000, InvalidImageURLError),
        (data_uri(solid(RED), "text/plain"), InvalidImageURLError),
        (data_uri(bytes(range(256)) * 8), ImageDecodeError),
        (data_uri(NOISE_PNG[: len(NOISE_PNG) // 2]), ImageDecodeError),
        (data_uri(png_header_only(2000, 2000)), ImageTooLargeError),
        (data_uri(png_header_only(100_000, 100_000)), ImageTooLargeError),
    ],
    ids=["bad-base64", "text-media-type", "random-bytes", "truncated-png", "bomb", "huge-bomb"],
)
def test_bad_data_uris_raise_the_right_error(uri: str, error: type[ImageError]) -> None:
    with pytest.raises(error) as info:
        load(uri)
    assert len(str(info.value)) < 300  # never echoes the payload


@pytest.mark.parametrize("url", ["ftp://h/a.png", "javascript:alert(1)", "/etc/passwd", "", " "])
def test_unsupported_urls_are_invalid(url: str) -> None:
    with pytest.raises(InvalidImageURLError, match="unsupported image URL") as info:
        load(url, LOCAL)
    assert "alert" not in str(info.value)


@pytest.mark.parametrize(
    "name, value",
    [("max_pixels", 0), ("max_fetch_bytes", 0), ("fetch_timeout_s", 0.0), ("max_redirects", -1),
     ("allowed_media_domains", ("https://example.com",))],
)
def test_policy_rejects_bad_values(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        MediaPolicy(**{"max_pixels": 10, name: value})  # type: ignore[arg-type]


@dataclass
class Reply:
    """What the local site sends for one path."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    repeat_every_s: float | None = None  # resend body at this pace, no Content-Length


def moved(location: str) -> Reply:
    return Reply(302, headers={"Location": location})


class LocalSite:
    """A real HTTP/1.0 server on 127.0.0.1, port 0, serving ``routes`` from a thread."""

    def __init__(self) -> None:
        self.routes: dict[str, Reply] = {"/red.png": Reply(body=solid(RED))}
        self.hosts: list[str] = []  # the Host header of every request, in order
        self.stop = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.httpd.server_address[1]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        site = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                site.hosts.append(self.headers.get("Host", ""))
                reply = site.routes.get(self.path, Reply(404, b"no such image"))
                try:
                    self.send_response(reply.status)
                    headers = {"Content-Length": str(len(reply.body))} | reply.headers
                    for key, value in headers.items():
                        if key != "Content-Length" or reply.repeat_every_s is None:
                            self.send_header(key, value)
                    self.end_headers()
                    self.wfile.write(reply.body)
                    while reply.repeat_every_s and not site.stop.wait(reply.repeat_every_s):
                        self.wfile.write(reply.body)
                        self.wfile.flush()
                except OSError:
                    pass  # the client gave up, as the tests intend

            def log_message(self, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def site() -> Iterator[LocalSite]:
    local = LocalSite()
    threading.Thread(target=local.httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield local
    local.stop.set()
    local.httpd.shutdown()
    local.httpd.server_close()


def test_http_fetch_allowed_only_with_private_networks(site: LocalSite) -> None:
    with pytest.raises(MediaFetchError, match="non-public address"):
        load(site.url("/red.png"))
    assert site.hosts == []  # refused before connecting
    image = load(site.url("/red.png"), LOCAL)
    assert image.size == (8, 6)
    assert_colour(image, RED)
    assert site.hosts == [f"127.0.0.1:{site.port}"]


@pytest.mark.parametrize("max_redirects, ok", [(3, True), (2, False)])
def test_redirect_chain_limit(site: LocalSite, max_redirects: int, ok: bool) -> None:
    site.routes |= {"/r3": moved(site.url("/r2", "localhost")), "/r2": moved("/r1"), "/r1": moved("red.png")}
    policy = MediaPolicy(100, allow_private_networks=True, max_redirects=max_redirects)
    if ok:
        assert_colour(load(site.url("/r3"), policy), RED)
        assert site.hosts[1:] == [f"localhost:{site.port}"] * 3  # the name survives IP pinning
    else:
        with pytest.raises(MediaFetchError, match="redirected more than 2 times"):
            load(site.url("/r3"), policy)


def test_size_cap_from_content_length_and_from_stream(site: LocalSite) -> None:
    site.routes["/big.png"] = Reply(body=NOISE_PNG)
    site.routes["/endless"] = Reply(body=b"\0" * 4096, repeat_every_s=0.001)
    policy = MediaPolicy(10_000, max_fetch_bytes=10_000, allow_private_networks=True)
    with pytest.raises(MediaFetchError, match=r"10000-byte limit \(Content-Length\)"):
        load(site.url("/big.png"), policy)
    with pytest.raises(MediaFetchError, match="10000-byte limit$"):
        load(site.url("/endless"), policy)


def test_slow_server_times_out_overall(site: LocalSite) -> None:
    site.routes["/slow"] = Reply(body=b"x", repeat_every_s=0.05)  # never idle for a read timeout
    started = time.monotonic()
    with pytest.raises(MediaFetchError, match="timed out after 0.5 s"):
        load(site.url("/slow"), MediaPolicy(100, fetch_timeout_s=0.5, allow_private_networks=True))
    assert time.monotonic() - started < 1.5


def test_http_error_status_and_domain_allow_list(site: LocalSite) -> None:
    with pytest.raises(MediaFetchError, match="HTTP 404 Not Found"):
        load(site.url("/missing.png"), LOCAL)
    policy = MediaPolicy(100, allow_private_networks=True, allowed_media_domains=("localhost",))
    assert_colour(load(site.url("/red.png", host="localhost"), policy), RED)
    with pytest.raises(MediaFetchError, match="not in the allowed media domains"):
        load(site.url("/red.png"), policy)  # 127.0.0.1 is not the name "localhost"


def test_unreachable_address_falls_back_to_the_next(site: LocalSite) -> None:
    async def resolve(host: str, port: int) -> list[str]:
        return ["::1", "127.0.0.1"]  # nothing listens on [::1]:port

    url = site.url("/red.png", host="img.test")
    assert_colour(asyncio.run(load_image_url(url, LOCAL, resolver=resolve)), RED)
    assert site.hosts == [f"img.test:{site.port}"]


def test_load_image_urls_keeps_order_and_cancels_on_error(site: LocalSite) -> None:
    site.routes |= {"/blue.png": Reply(body=solid(BLUE)), "/slow": Reply(body=b"x", repeat_every_s=0.05)}
    urls = [data_uri(solid(RED)), site.url("/blue.png"), data_uri(solid(GREEN))]
    for image, colour in zip(asyncio.run(load_image_urls(urls, LOCAL)), (RED, BLUE, GREEN), strict=True):
        assert_colour(image, colour)
    started = time.monotonic()
    with pytest.raises(InvalidImageURLError):
        asyncio.run(load_image_urls([site.url("/slow"), "ftp://h/x.png"], LOCAL))
    assert time.monotonic() - started < 1.0  # the slow fetch was cancelled, not awaited


ADDRESSES = {"img.example.com": [PUBLIC_IP], "example.com": [PUBLIC_IP], "badexample.com": [PUBLIC_IP],
             "example.com.evil.net": [PUBLIC_IP], "cdn.other.org": [PUBLIC_IP],
             "internal.example.com": ["10.0.0.7"], "dual.example.com": [PUBLIC_IP, "fd00::1"]}
REDIRECTS = {"/to-internal": "http://internal.example.com/red.png", "/to-file": "file:///etc/passwd",
             "/to-loopback": "http://127.0.0.1/red.png", "/to-other": "https://cdn.other.org/red.png"}


async def stub_resolve(host: str, port: int) -> list[str]:
    """Names from ADDRESSES; an IP literal resolves to itself."""
    return ADDRESSES.get(host.rstrip(".").lower(), [host] if host[0].isdigit() or ":" in host else [])


def load_public(url: str, seen: list[httpx.Request], policy: MediaPolicy = POLICY) -> Image.Image:
    """Load through httpx.MockTransport standing in for public hosts; requests go to ``seen``."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path in REDIRECTS:
            return httpx.Response(302, headers={"Location": REDIRECTS[request.url.path]})
        return httpx.Response(200 if request.url.path == "/red.png" else 404, content=solid(RED))

    async def run() -> Image.Image:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            return await load_image_url(url, policy, client, resolver=stub_resolve)

    return asyncio.run(run())


def test_connection_is_pinned_to_the_checked_address_with_host_and_sni() -> None:
    seen: list[httpx.Request] = []
    assert_colour(load_public("https://img.example.com/red.png", seen), RED)
    assert [(r.url.host, r.headers["host"], r.extensions["sni_hostname"]) for r in seen] == [
        (PUBLIC_IP, "img.example.com", "img.example.com")
    ]


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "100.64.0.1",
     "224.0.0.1", "240.0.0.1", "[::1]", "[::]", "[fe80::1]", "[fc00::1]", "[fec0::1]", "[ff02::1]",
     "[2001:db8::1]", "[::ffff:127.0.0.1]", "[::ffff:10.0.0.1]", "[2002:7f00:1::]", "[64:ff9b::a00:1]"],
)
def test_non_public_addresses_refused(address: str) -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(MediaFetchError, match="non-public address"):
        load_public(f"http://{address}/red.png", seen)
    assert seen == []


@pytest.mark.parametrize("address", [PUBLIC_IP, "[2606:4700::1111]", f"[::ffff:{PUBLIC_IP}]"])
def test_public_addresses_allowed(address: str) -> None:
    assert_colour(load_public(f"http://{address}/red.png", []), RED)


@pytest.mark.parametrize(
    "path, match",
    [("/to-internal", "non-public"), ("/to-loopback", "non-public"), ("/to-file", "non-http")],
)
def test_redirect_to_a_refused_url_is_refused_before_connecting(path: str, match: str) -> None:
    seen: list[httpx.Request] = []
    with pytest.raises(MediaFetchError, match=match):
        load_public(f"http://img.example.com{path}", seen)
    assert [request.url.path for request in seen] == [path]  # only the first hop was sent
    with pytest.raises(MediaFetchError, match="non-public"):  # one private answer is enough
        load_public("http://dual.example.com/red.png", seen)


@pytest.mark.parametrize(
    "url, ok",
    [("https://example.com/red.png", True), ("https://IMG.Example.com./red.png", True),
     ("https://badexample.com/red.png", False), ("https://example.com.evil.net/red.png", False),
     ("https://img.example.com/to-other", False)],
)
def test_domain_allow_list(url: str, ok: bool) -> None:
    policy = MediaPolicy(100, allowed_media_domains=("example.com",))
    if ok:
        assert_colour(load_public(url, [], policy), RED)
    else:
        with pytest.raises(MediaFetchError, match="not in the allowed media domains"):
            load_public(url, [], policy)


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "red.png").write_bytes(solid(RED))
    (tmp_path / "secret.png").write_bytes(solid(BLUE))
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "alias.png").symlink_to(root / "red.png")
    return root


def test_file_urls_under_the_allowed_directory(media_root: Path) -> None:
    policy = MediaPolicy(100, allowed_local_media_path=media_root)
    assert_colour(load(f"file://{media_root}/red.png", policy), RED)
    assert_colour(load(f"file://{media_root}/alias.png", policy), RED)
    with pytest.raises(MediaFetchError, match="10-byte limit"):
        load(f"file://{media_root}/red.png", MediaPolicy(100, 10, allowed_local_media_path=media_root))


@pytest.mark.parametrize(
    "name, match",
    [("../secret.png", "outside"), ("%2E%2E/secret.png", "outside"), ("escape.png", "outside"),
     ("missing.png", "does not exist"), ("", "not a regular file")],
)
def test_file_urls_outside_or_missing_refused(media_root: Path, name: str, match: str) -> None:
    with pytest.raises(MediaFetchError, match=match):
        load(f"file://{media_root}/{name}", MediaPolicy(100, allowed_local_media_path=media_root))


def test_file_urls_refused_without_allowed_directory_or_with_a_host(media_root: Path) -> None:
    with pytest.raises(MediaFetchError, match="disabled"):
        load(f"file://{media_root}/red.png", LOCAL)
    with pytest.raises(MediaFetchError, match="on this host"):
        load(f"file://otherhost{media_root}/red.png", MediaPolicy(100, allowed_local_media_path=media_root))
