"""Tier 2: tokens and TLS that failed late or vaguely (issue 23, item 10) now fail at start,
or at once on the client, naming the file, the flag or gRPC's reason."""

import logging

import pytest

import sidecar
from sidecar._src.core import env as env_lib
from tests.support.paths import DATA
from tests.support.tls import CA, CLIENT, CLIENT_KEY, SERVER, SERVER_KEY

pytestmark = pytest.mark.server


@pytest.mark.parametrize("token,match", [
    ("s3cret\n", r"token ends in '\\n' after 6 characters, as a token file's text does"),
    ("s3cr\u00e9t", r"token holds .* at position \d+: a token must be visible ASCII"),
    ("s3 cret", r"token holds .* at position \d+: a token must be visible ASCII"),
    ("s3cret\r", r"token ends in '\\r' after 6 characters")],
    ids=["newline", "non-ascii", "space", "cr"])
def test_a_token_no_client_could_send_is_refused_at_start(make_server, token, match):
  with pytest.raises(ValueError, match=match):
    make_server(token=token)
  with pytest.raises(sidecar.InvalidArgumentError, match="the " + match):
    sidecar.jax.Controller(["127.0.0.1:1"], token=token, connect_timeout=1)


def test_sidecar_serve_refuses_a_token_file_with_a_bad_character(tmp_path, capsys):
  from sidecar._src.tools import cli
  bad = tmp_path / "token"
  bad.write_text("s3cr\u00e9t\n")
  bad.chmod(0o600)
  code = cli.main(["serve", "--token-file", str(bad), "--socket", str(tmp_path / "s.sock"),
                   "--port", "0", "--health-port", "0", "--shm-size", "8MiB"])
  assert code == 2
  assert "token holds '\u00e9' at position 4" in capsys.readouterr().err


def test_a_token_file_others_can_read_is_warned_of(tmp_path, caplog):
  path = tmp_path / "token"
  path.write_text("s3cret\n")
  path.chmod(0o644)
  with caplog.at_level(logging.WARNING):
    assert env_lib.token(str(path)) == "s3cret"
  assert f"token file {path} is readable by everyone (mode 644)" in caplog.text
  assert f"chmod 600 {path}" in caplog.text
  caplog.clear()
  path.chmod(0o600)
  with caplog.at_level(logging.WARNING):
    env_lib.token(str(path))
  assert "readable" not in caplog.text


@pytest.mark.parametrize("kw,match", [
    ({"tls_cert": SERVER, "tls_key": CLIENT_KEY}, "the key does not match the certificate"),
    ({"tls_cert": SERVER, "tls_key": SERVER_KEY, "tls_client_ca": SERVER_KEY},
     "--tls-client-ca .* holds no CA certificate"),
], ids=["key-mismatch", "ca-is-a-key"])
def test_tls_files_that_do_not_fit_say_so_at_start(make_server, kw, match):
  with pytest.raises(OSError, match=match) as info:
    make_server(**kw)
  assert "pick another" not in str(info.value)  # not "cannot listen ... pick another --port"


def test_an_expired_server_certificate_is_warned_of_at_start(make_server, caplog):
  tls = DATA / "tls"
  with caplog.at_level(logging.WARNING):
    make_server(tls_cert=str(tls / "expired.pem"), tls_key=str(tls / "expired.key"))
  assert "expired on 2020-01-02 00:00:00 UTC" in caplog.text and "renew" in caplog.text


@pytest.mark.parametrize("client,match", [
    ({"tls_ca": CA}, "refused the TLS connection.*does it want a client certificate"),
    ({"tls_ca": CLIENT, "tls_cert": CLIENT, "tls_key": CLIENT_KEY},
     "refused the TLS connection.*CERTIFICATE_VERIFY_FAILED"),
], ids=["no-client-certificate", "unknown-ca"])
def test_a_client_refused_by_tls_is_told_why_at_once(make_server, client, match):
  server = make_server(tls_cert=SERVER, tls_key=SERVER_KEY, tls_client_ca=CA)
  with pytest.raises(sidecar.HostLostError, match=match):  # gRPC's reason, as it fails
    sidecar.jax.Controller([f"127.0.0.1:{server.port}"], attach=False, connect_timeout=60,
                       **client)
