"""Who may use a sidecar's control port: the token each RPC presents, and the port's TLS.

Every RPC but health's carries ``authorization: Bearer <token>`` of one of the tokens in
force (:class:`TokenAuth`, read at each RPC: a reload swaps them); with mTLS a pool's
tenants named by certificate come without one. The TLS files are checked at start, so a
key that is not the certificate's is said at once, not as gRPC's "cannot listen".
"""

from __future__ import annotations

import hmac
import logging
import time

import grpc

from sidecar._src.core import options as options_lib
from sidecar._src.server.tenancy import tenants as tenants_lib
from sidecar._src.wire import protocol

log = logging.getLogger(__name__)


def client_of(tokens: dict[bytes, str], metadata) -> str | None:
  """The name of the client whose token ``metadata`` carries, compared in constant time
  with every token (how long it takes says nothing of which one came close)."""
  meta = dict(metadata or ())
  given = meta.get(protocol.AUTH_KEY) or ""
  given = given.encode(errors="replace") if isinstance(given, str) else bytes(given)
  found = None
  for expected, name in tokens.items():
    if hmac.compare_digest(given, expected):
      found = name
  return found


# On a unix: socket health shares the server with the services: health asks no token
# (it tells only whether the sidecar serves), as on the TCP health port.
HEALTH_METHODS = "/grpc.health.v1.Health/"


def refusal(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
  """A handler that answers ``code`` at once, having read nothing of the request.

  Request-streaming, whatever the method: gRPC reads a unary request in a server thread
  before its handler runs, so a refusal handled as unary held that thread until the
  request came. A client without a token that sent a call's headers and never its message
  held one for ever: 64 such calls on one connection took every thread of the control
  port, and no client could handshake any more (issue 76, attack round eight).
  """
  def refuse(requests, context):
    context.abort(code, details)
  return grpc.stream_stream_rpc_method_handler(refuse)


class TokenAuth(grpc.ServerInterceptor):
  """Refuses every RPC but health's without ``authorization: Bearer <token>``, of one of
  ``tokens`` (read at each RPC: a reload swaps them); a token a reload revoked is refused
  with the reason (its tenant was removed from the pool file, say). A refusal reads
  nothing of its request (``refusal``): it holds no server thread.
  """

  def __init__(self, tokens: tenants_lib.Tokens, *, mtls: bool = False):
    self._tokens = tokens
    # With mTLS every connection has a certificate the CA signed: a pool's tenants named
    # by certificate (tls_names) come without a token, and the service says whose.
    self._mtls = mtls

    self._deny = refusal(
        grpc.StatusCode.UNAUTHENTICATED,
        "AuthenticationError: missing or wrong token; present the job's token: token=... to "
        "a Controller, --token-file to a sidecar command, or SIDECAR_TOKEN / "
        "SIDECAR_TOKEN_FILE to either")
    # A handshake that carries the peer token's metadata.
    self._deny_link = refusal(
        grpc.StatusCode.UNAUTHENTICATED,
        "AuthenticationError: another sidecar's replica link (the sidecars' own, its "
        f"handshake carries '{protocol.REPLICA_KEY}') presented no token this sidecar takes: "
        "the sidecars of one job share one peer token; give every sidecar the same "
        "--peer-token-file (or SIDECAR_PEER_TOKEN)")

  def _revoked(self, why: str):
    return refusal(grpc.StatusCode.UNAUTHENTICATED,
                   f"AuthenticationError: {why}; its token no longer works on this sidecar: "
                   "ask the pool's operator")

  def intercept_service(self, continuation, handler_call_details):
    if handler_call_details.method.startswith(HEALTH_METHODS):
      return continuation(handler_call_details)
    metadata = handler_call_details.invocation_metadata
    if self._mtls and (self._tokens.tls or self._tokens.revoked_tls) and not any(
        k == protocol.AUTH_KEY for k, _ in metadata or ()):
      return continuation(handler_call_details)
    if client_of(self._tokens.table, metadata) is None:
      if self._tokens.revoked and (why := client_of(self._tokens.revoked, metadata)):
        return self._revoked(why)
      return (self._deny_link if any(k == protocol.REPLICA_KEY for k, _ in metadata or ())
              else self._deny)
    return continuation(handler_call_details)


def tls_credentials(o: options_lib.ServerOptions) -> grpc.ServerCredentials | None:
  """The control port's TLS (mTLS with a client CA) from PEM files; None without TLS."""
  if o.tls_cert is None or o.tls_key is None:
    return None
  def read(path: str, flag: str) -> bytes:
    try:
      with open(path, "rb") as f:
        return f.read()
    except OSError as e:
      raise OSError(e.errno, f"cannot read {flag} {path}: {e.strerror}") from None
  check_tls_files(o.tls_cert, o.tls_key, o.tls_client_ca)
  ca = None if o.tls_client_ca is None else read(o.tls_client_ca, "--tls-client-ca")
  return grpc.ssl_server_credentials(
      [(read(o.tls_key, "--tls-key"), read(o.tls_cert, "--tls-cert"))], root_certificates=ca,
      require_client_auth=ca is not None)


def check_tls_files(cert: str, key: str, client_ca: str | None) -> None:
  """Says at start what gRPC would only report as "cannot listen": a key that is not the
  certificate's, a CA file that holds no certificate; warns of a certificate expired.

  Raises:
    OSError: naming the file, the flag and OpenSSL's reason.
  """
  import ssl
  try:
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
  except (ssl.SSLError, OSError) as e:
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
    what = ("the key does not match the certificate" if "MISMATCH" in str(e)
            else f"they cannot be loaded: {reason}")
    raise OSError(f"--tls-cert {cert} and --tls-key {key}: {what}; give the certificate "
                  "chain (PEM) and its own private key") from None
  if client_ca is not None:
    try:
      ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(client_ca)
    except (ssl.SSLError, OSError) as e:
      raise OSError(f"--tls-client-ca {client_ca} holds no CA certificate ({e}); give the "
                    "PEM certificate of the CA that signs the clients' certificates") from None
  try:
    decoded = ssl._ssl._test_decode_cert(cert)  # type: ignore[attr-defined]  # no public way
    not_after = ssl.cert_time_to_seconds(decoded["notAfter"])
  except (ssl.SSLError, OSError, KeyError, ValueError, AttributeError):
    return
  if not_after < time.time():
    log.warning("--tls-cert %s expired on %s: clients will refuse it; renew the certificate",
                cert, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(not_after)))
