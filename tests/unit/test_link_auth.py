"""link_auth: HKDF as RFC 5869 defines it, and a handshake proof that binds what it must."""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_worker.transfer.backends.host import link_auth


@settings(max_examples=50)
@given(
    secret=st.binary(min_size=1, max_size=80),
    info=st.binary(max_size=40),
    salt=st.binary(max_size=40),
    length=st.integers(1, 100),
)
def test_hkdf_matches_cryptographys_implementation(secret: bytes, info: bytes, salt: bytes, length: int) -> None:
    """The upstream's own implementation (pyca/cryptography's HKDF) is the reference."""
    expected = HKDF(algorithm=hashes.SHA256(), length=length, salt=salt or None, info=info).derive(secret)
    # RFC 5869 2.2: an absent salt is HashLen zero bytes, which HMAC treats like an empty key.
    assert link_auth.hkdf(secret, info, length, salt=salt) == expected


def test_rfc5869_test_case_1() -> None:
    ikm = bytes.fromhex("0b" * 22)
    okm = link_auth.hkdf(
        ikm, bytes.fromhex("f0f1f2f3f4f5f6f7f8f9"), 42, salt=bytes.fromhex("000102030405060708090a0b0c")
    )
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")


def test_each_purpose_gets_its_own_key_and_none_is_the_token() -> None:
    link = link_auth.derive_key("token", link_auth.PURPOSE_LINK)
    cap = link_auth.derive_key("token", link_auth.PURPOSE_CAPABILITY)
    assert len(link) == len(cap) == 32 and link != cap
    assert link_auth.derive_key("token", link_auth.PURPOSE_LINK) == link
    assert link_auth.derive_key("other", link_auth.PURPOSE_LINK) != link
    with pytest.raises(ValueError):
        link_auth.derive_key("", link_auth.PURPOSE_LINK)


def test_proofs_bind_the_key_both_nonces_the_role_and_the_claims() -> None:
    key, cn, sn = os.urandom(32), os.urandom(32), os.urandom(32)
    proof = link_auth.client_proof(key, cn, sn, "10.0.0.1", "hostA")
    assert link_auth.proofs_equal(proof, link_auth.client_proof(key, cn, sn, "10.0.0.1", "hostA"))
    for other in (
        link_auth.client_proof(os.urandom(32), cn, sn, "10.0.0.1", "hostA"),
        link_auth.client_proof(key, os.urandom(32), sn, "10.0.0.1", "hostA"),
        link_auth.client_proof(key, cn, os.urandom(32), "10.0.0.1", "hostA"),
        link_auth.client_proof(key, cn, sn, "10.0.0.2", "hostA"),
        link_auth.client_proof(key, cn, sn, "10.0.0.1", "hostB"),
    ):
        assert not link_auth.proofs_equal(proof, other)
    # A server's proof is not a client's: a proof cannot be reflected back.
    assert not link_auth.proofs_equal(link_auth.server_proof(key, cn, sn), link_auth.client_proof(key, cn, sn, "", ""))
    assert not link_auth.proofs_equal(proof, None) and not link_auth.proofs_equal(proof, 42)


@pytest.mark.parametrize("bad", [None, 5, "ab", "zz" * 32, "00" * 31])
def test_a_nonce_must_be_32_bytes_of_hex(bad: object) -> None:
    with pytest.raises(link_auth.AuthError):
        link_auth.parse_nonce(bad)


def test_a_key_option_must_be_hex_and_long_enough() -> None:
    assert link_auth.parse_key("ab" * 16) == b"\xab" * 16
    with pytest.raises(ValueError, match="hex"):
        link_auth.parse_key("not hex")
    with pytest.raises(ValueError, match="at least 16"):
        link_auth.parse_key("ab" * 8)
