"""UserSig (TLSSigAPIv2): DESIGN.md's vector, decoding, verification codes, the cache."""

from __future__ import annotations

import pytest

from room_outbox.plugins.tencent_im.usersig import (
    UserSigCache,
    UserSigError,
    decode_usersig,
    gen_usersig,
    hmac_sig,
    verify_usersig,
)

KEY = "5bd2850fff3ecb11d7c805251c51ee463a25727bddc2385f3fa8bfee1bb93b5e"
APP = 1400000000
ISSUED = 1700000000
EXPIRE = 15552000


def test_design_vector() -> None:
    assert hmac_sig(KEY, "xiaojun", APP, ISSUED, EXPIRE) == "LvA7d/Iw7gSsnskvVzBDPOCCDbuNCw4GHwTC0bip+B4="


def test_decode_round_trip() -> None:
    usersig = gen_usersig(APP, KEY, "xiaojun", EXPIRE, ISSUED)
    assert not set(usersig) & set("+/=")  # Tencent's alphabet, safe in a query string
    assert decode_usersig(usersig) == {
        "TLS.ver": "2.0",
        "TLS.identifier": "xiaojun",
        "TLS.sdkappid": APP,
        "TLS.expire": EXPIRE,
        "TLS.time": ISSUED,
        "TLS.sig": "LvA7d/Iw7gSsnskvVzBDPOCCDbuNCw4GHwTC0bip+B4=",
    }
    assert verify_usersig(usersig, sdkappid=APP, identifier="xiaojun", key=KEY, now=ISSUED + 1)["TLS.time"] == ISSUED


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"key": "another-key"}, 70009),
        ({"identifier": "someone"}, 70013),
        ({"sdkappid": APP + 1}, 70014),
        ({"now": ISSUED + EXPIRE}, 70001),
    ],
)
def test_verification_failures_carry_tencent_codes(change: dict[str, object], code: int) -> None:
    usersig = gen_usersig(APP, KEY, "xiaojun", EXPIRE, ISSUED)
    kwargs: dict[str, object] = {"sdkappid": APP, "identifier": "xiaojun", "key": KEY, "now": ISSUED + 1, **change}
    with pytest.raises(UserSigError) as info:
        verify_usersig(usersig, **kwargs)  # type: ignore[arg-type]
    assert info.value.code == code


def test_garbage_is_70003() -> None:
    with pytest.raises(UserSigError) as info:
        decode_usersig("not*a-usersig")
    assert info.value.code == 70003


def test_cache_reuses_then_renews_at_half_life_and_reports_each_new_sig() -> None:
    now = [ISSUED + 0.0]
    issued: list[str] = []
    cache = UserSigCache(APP, "admin", KEY, ttl=100, on_new=issued.append, clock=lambda: now[0])
    first = cache.get()
    now[0] += 49
    assert cache.get() == first and issued == [first]
    now[0] += 1  # half of the lifetime gone: renew, well before Tencent would say 70001
    second = cache.get()
    assert second != first and issued == [first, second]
    assert decode_usersig(second)["TLS.time"] == ISSUED + 50
    cache.invalidate()
    third = cache.get()
    assert issued == [first, second, third]
