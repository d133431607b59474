"""Erasure credentials: generation, file permissions, principals and who may erase what."""

from __future__ import annotations

import json
import stat

from server.erasure.auth import (
    Authorizer,
    Principal,
    bearer_token,
    generate_credentials,
    hash_token,
)


def test_generate_and_resolve_principals(tmp_path):
    path = tmp_path / "creds" / "credentials.json"
    tokens = generate_credentials(3, path)
    assert set(tokens) == {"admin", "silo-0", "silo-1", "silo-2"}
    assert len(set(tokens.values())) == 4 and all(len(t) >= 40 for t in tokens.values())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = json.loads(path.read_text())
    # only hashes on disk, never a token
    assert set(stored) == {hash_token(t) for t in tokens.values()}
    assert not any(t in path.read_text() for t in tokens.values())

    auth = Authorizer.from_file(path)
    assert auth.principal(tokens["admin"]) == Principal("admin", "admin")
    assert auth.principal(tokens["silo-1"]) == Principal("silo-1", "silo", 1)
    assert auth.principal("wrong") is None
    assert auth.principal("") is None and auth.principal(None) is None
    assert auth.principal(tokens["silo-1"] + "x") is None


def test_regenerate_overwrites_and_old_tokens_stop_working(tmp_path):
    path = tmp_path / "credentials.json"
    old = generate_credentials(1, path)
    new = generate_credentials(1, path)
    auth = Authorizer.from_file(path)
    assert auth.principal(old["silo-0"]) is None and auth.principal(new["silo-0"]) is not None
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["credentials.json"]  # no temp file left


def test_may_erase():
    admin, silo2 = Principal("admin", "admin"), Principal("silo-2", "silo", 2)
    assert all(Authorizer.may_erase(admin, s) for s in range(5))
    assert Authorizer.may_erase(silo2, 2)
    assert not any(Authorizer.may_erase(silo2, s) for s in (0, 1, 3, -1))


def test_bearer_token_parsing():
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("x", "y"), ("authorization", "bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token([]) is None and bearer_token(None) is None


def test_tokens_never_start_with_a_dash(monkeypatch):
    # Prepare: the generator first draws a token an argument parser would take for an option
    import server.erasure.auth as auth

    draws = iter(["-starts-with-dash", "fine-token"])
    monkeypatch.setattr(auth.secrets, "token_urlsafe", lambda n: next(draws))
    # Execute / Assert
    assert auth.new_token() == "fine-token"
