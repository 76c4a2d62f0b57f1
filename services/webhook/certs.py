"""The webhook's TLS, without cert-manager: a CA and a serving certificate
for the webhook's Service, kept in a Secret shared by every replica and
renewed a month before they expire; the CA goes into the
MutatingWebhookConfiguration's ``caBundle``, which the API server verifies
the webhook with. With cert-manager (the overlay), SMR_WEBHOOK_CERT_DIR
names the mounted certificate and none of this runs."""

from __future__ import annotations

import base64
import datetime as dt
import logging
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from smr.config import Settings
from smr.contract.errors import TemporaryError

log = logging.getLogger("smr.webhook")

VALID = dt.timedelta(days=365)
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class Tls:
    ca: bytes  # PEM
    cert: bytes  # PEM
    key: bytes  # PEM

    def names(self) -> list[str]:
        c = x509.load_pem_x509_certificate(self.cert)
        return c.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)

    def fresh(self, names: list[str], now: dt.datetime) -> bool:
        """Valid for a month more, for these names, and signed by ``ca``."""
        try:
            c = x509.load_pem_x509_certificate(self.cert)
            ca = x509.load_pem_x509_certificate(self.ca)
            c.verify_directly_issued_by(ca)
        except (ValueError, TypeError, x509.InvalidSignature):  # type: ignore[attr-defined]
            return False
        soon = now + RENEW_BEFORE
        return (c.not_valid_after_utc > soon and ca.not_valid_after_utc > soon
                and set(names) <= set(self.names()))


def service_names(s: Settings) -> list[str]:
    svc, ns = s.webhook_service, s.webhook_namespace
    return [svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local"]


def issue(names: list[str], now: dt.datetime | None = None) -> Tls:
    """A new CA and a serving certificate for ``names`` (ECDSA P-256)."""
    now = now or dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "smr-webhook-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALID)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + VALID)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return Tls(ca.public_bytes(pem), cert.public_bytes(pem),
               key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption()))


class CertKeeper:
    """Makes sure the Secret holds a fresh certificate and the webhook
    configuration trusts its CA; every replica may run it at once."""

    def __init__(self, api: client.ApiClient, s: Settings) -> None:
        self.core = client.CoreV1Api(api)
        self.admission = client.AdmissionregistrationV1Api(api)
        self.s = s

    async def ensure(self) -> Tls:
        names = service_names(self.s)
        now = dt.datetime.now(dt.UTC)
        for _ in range(3):  # another replica may write between our read and write
            secret = await self._read()
            tls = _from_secret(secret)
            if tls is None or not tls.fresh(names, now):
                tls = issue(names, now)
                if not await self._write(secret, tls):
                    continue
                log.info("issued a certificate for %s, valid until %s", ", ".join(names),
                         (now + VALID).date())
            await self._trust(tls.ca)
            return tls
        raise TemporaryError(f"secret {self.s.webhook_secret} kept changing under us",
                             code="webhook-tls")

    async def _read(self) -> client.V1Secret | None:
        try:
            return await self.core.read_namespaced_secret(self.s.webhook_secret,
                                                          self.s.webhook_namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise TemporaryError(f"cannot read secret {self.s.webhook_namespace}/"
                                 f"{self.s.webhook_secret}: {e.reason}", code="kube-api",
                                 hint="the webhook's Role needs get/create/update on it") from None

    async def _write(self, old: client.V1Secret | None, tls: Tls) -> bool:
        """Create or replace the Secret; False if someone else wrote it first."""
        data = {k: base64.b64encode(v).decode() for k, v in
                (("ca.crt", tls.ca), ("tls.crt", tls.cert), ("tls.key", tls.key))}
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(
                name=self.s.webhook_secret, namespace=self.s.webhook_namespace,
                resource_version=old.metadata.resource_version if old else None),
            type="kubernetes.io/tls", data=data)
        try:
            if old is None:
                await self.core.create_namespaced_secret(self.s.webhook_namespace, body)
            else:
                await self.core.replace_namespaced_secret(self.s.webhook_secret,
                                                          self.s.webhook_namespace, body)
        except ApiException as e:
            if e.status == 409:
                return False
            raise TemporaryError(f"cannot write secret {self.s.webhook_secret}: {e.reason}",
                                 code="kube-api") from None
        return True

    async def _trust(self, ca: bytes) -> None:
        """Put ``ca`` into every webhook of the configuration (if not there yet)."""
        bundle = base64.b64encode(ca).decode()
        for _ in range(3):
            try:
                cfg = await self.admission.read_mutating_webhook_configuration(
                    self.s.webhook_config)
            except ApiException as e:
                if e.status == 404:
                    log.warning("no MutatingWebhookConfiguration %s: pods are not mutated "
                                "until it exists (deploy/kustomize/base has it)",
                                self.s.webhook_config)
                    return
                raise TemporaryError(f"cannot read the webhook configuration: {e.reason}",
                                     code="kube-api") from None
            hooks = cfg.webhooks or []
            if all(h.client_config.ca_bundle == bundle for h in hooks):
                return
            for h in hooks:
                h.client_config.ca_bundle = bundle
            try:
                await self.admission.replace_mutating_webhook_configuration(
                    self.s.webhook_config, cfg)
                log.info("webhook configuration %s now trusts the current CA",
                         self.s.webhook_config)
                return
            except ApiException as e:
                if e.status != 409:
                    raise TemporaryError(f"cannot update the webhook configuration: "
                                         f"{e.reason}", code="kube-api") from None
        raise TemporaryError("the webhook configuration kept changing", code="webhook-tls")


def _from_secret(secret: client.V1Secret | None) -> Tls | None:
    data = (secret.data or {}) if secret else {}
    try:
        return Tls(*(base64.b64decode(data[k]) for k in ("ca.crt", "tls.crt", "tls.key")))
    except (KeyError, ValueError):
        return None
