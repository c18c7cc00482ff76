"""The test certificates in tests/data/tls (valid to 2126): a CA, a server's and a client's."""

from tests.support.paths import DATA

TLS = DATA / "tls"
CA, SERVER, SERVER_KEY = str(TLS / "ca.pem"), str(TLS / "server.pem"), str(TLS / "server.key")
CLIENT, CLIENT_KEY = str(TLS / "client.pem"), str(TLS / "client.key")
