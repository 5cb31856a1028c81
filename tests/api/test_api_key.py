"""The bearer-key check: which key a call's Authorization headers carry, on both its paths (the route
dependency reads Starlette's header list, the body middleware the raw ASGI headers)."""

from __future__ import annotations

from mm_serve.api.api_key import api_key_ok, matching_key, scope_authorized

KEYS = ("key-a", "key-b")


def test_one_header_names_its_key_and_several_name_none() -> None:
    assert matching_key(["Bearer key-b"], KEYS) == "key-b"
    assert matching_key(["bearer key-a"], KEYS) == "key-a"  # the scheme in any case
    assert matching_key(["Bearer key-c"], KEYS) is None
    assert matching_key([], KEYS) is None
    assert matching_key(["Bearer key-a", "Bearer key-a"], KEYS) is None  # even the same key twice
    assert matching_key(["Bearer key-a", "Bearer key-b"], KEYS) is None
    assert matching_key(["key-a"], KEYS) is None  # no scheme


def test_raw_headers_follow_the_same_rule_and_no_keys_lets_everything_through() -> None:
    one = [(b"host", b"x"), (b"authorization", b"Bearer key-a")]
    assert scope_authorized(one, KEYS)
    assert not scope_authorized([*one, (b"authorization", b"Bearer key-a")], KEYS)
    assert not scope_authorized([(b"host", b"x")], KEYS)
    assert scope_authorized([(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")], ())
    assert api_key_ok([], ())
