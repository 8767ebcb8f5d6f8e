"""The broker's tokens loaded from the services' Secrets when the only operator replica starts
(operator/pdserve_operator/broker/tokens.py): a restarted operator serves workers'
re-registrations before kopf peering lets it reconcile (13 s at the default lifetime)."""

from __future__ import annotations

import base64

from pdserve_operator.broker import tokens as broker_tokens
from pdserve_operator.broker.view import NullBrokerView
from pdserve_operator.kube import KINDS, PDIS
from pdserve_operator.reconcile.children.meta import Owner, secret_name
from pdserve_operator.reconcile.children.secret import secret as child_secret
from support.kube_fake import fake_kube, reconcile, reconciler, service


class Recording(NullBrokerView):
    def __init__(self) -> None:
        self.tokens: dict[str, str] = {}

    def set_service_token(self, service_key: str, token: str) -> None:
        self.tokens[service_key] = token


def test_every_trusted_token_secret_of_every_namespace_is_loaded() -> None:
    kube = fake_kube()
    for ns in ("a", "b"):
        kube.inner.create(service("svc", ns))
        reconcile(reconciler(kube, iter([f"token-{ns}"])), ns, "svc")  # the operator made its Secret
    # Not trusted: the right name, but another controller; the right owner kind, but another service's name.
    foreign = child_secret(Owner("svc", "c", "u"), "forged")
    foreign["metadata"]["ownerReferences"][0]["kind"] = "Deployment"
    kube.inner.create(foreign)
    renamed = child_secret(Owner("other", "d", "u"), "forged")
    renamed["metadata"]["name"] = secret_name("svc")
    kube.inner.create(renamed)

    broker = Recording()
    assert broker_tokens.preload(kube, broker, []) == 2  # [] : every namespace
    assert broker.tokens == {"a/svc": "token-a", "b/svc": "token-b"}
    scoped = Recording()
    assert broker_tokens.preload(kube, scoped, ["b"]) == 1 and scoped.tokens == {"b/svc": "token-b"}
    secret = kube.inner.get(KINDS["Secret"], "a", secret_name("svc"))
    assert base64.b64decode(secret["data"]["token"]) == b"token-a"  # what was loaded is what is kept


def test_a_reconcile_that_read_a_service_before_its_deletion_does_not_give_its_token_back() -> None:
    """The deletion handler takes the token away (handlers.forget_service); a reconcile that
    read the service just before (the fake still holds it) must not set it again (seen in the
    e2e deletion test: the broker kept a deleted service's token). A new service of the same
    name is another object (another uid) and gets its token."""
    kube = fake_kube()
    kube.inner.create(service("svc", "a"))
    broker = Recording()
    rec = reconciler(kube, iter(["token-1", "token-2"]))
    rec.broker = broker
    reconcile(rec, "a", "svc")
    assert broker.tokens == {"a/svc": "token-1"}
    uid = kube.inner.get(PDIS, "a", "svc")["metadata"]["uid"]
    broker.tokens.clear()  # the deletion handler's remove_service
    rec.forget("a", "svc", uid)
    reconcile(rec, "a", "svc")  # the stale read: the service is still there for it
    assert broker.tokens == {}
    kube.inner.delete(PDIS, "a", "svc")
    kube.inner.create(service("svc", "a"))  # recreated: a new uid
    assert kube.inner.get(PDIS, "a", "svc")["metadata"]["uid"] != uid
    reconcile(rec, "a", "svc")
    assert broker.tokens == {"a/svc": "token-2"}  # (the old Secret is the old object's: not trusted)
