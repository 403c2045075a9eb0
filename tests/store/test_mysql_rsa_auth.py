"""MySQL 8's default authentication (caching_sha2_password) over a connection without TLS:
PyMySQL sends the password RSA-encrypted with the server's key, which needs `cryptography`
(PyMySQL's ``rsa`` extra). MariaDB never asks for it, so the exchange is checked here in part."""

from __future__ import annotations

import importlib.metadata
import os

import pymysql._auth
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa


def test_room_outbox_depends_on_pymysql_with_its_rsa_extra() -> None:
    requires = [r.replace(" ", "") for r in importlib.metadata.requires("room-outbox") or ()]
    assert any(r.startswith("PyMySQL[rsa]") for r in requires), requires


def test_pymysql_encrypts_the_password_for_the_servers_rsa_key() -> None:
    server_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_pem = server_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    scramble = os.urandom(20)
    sealed = pymysql._auth.sha2_rsa_encrypt(b"s3cret-pw", scramble, public_pem)  # what the client sends
    oaep = padding.OAEP(mgf=padding.MGF1(algorithm=hashes.SHA1()), algorithm=hashes.SHA1(), label=None)
    assert pymysql._auth._xor_password(server_key.decrypt(sealed, oaep), scramble) == b"s3cret-pw\0"
