"""Credentials bound to one member (#58 A4): what the broker admits a registration by
(broker/identity.py), the cluster's TokenReview answer (broker/token_review.py), and what the
operator renders into a pod so that it can prove which member it is."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve_common import credentials as C
from pdserve_common import pod_env as E
from pdserve_operator.broker.identity import MemberCredentials, PodIdentity
from pdserve_operator.broker.token_review import POD_NAME_EXTRA, TokenReviewer, identity_of
from pdserve_operator.kube import KubeError

SERVICE = "ns/svc"


def test_a_member_credential_proves_one_member_of_one_role_of_one_service() -> None:
    members = MemberCredentials()
    members.set(SERVICE, "tok")
    own = C.member_credential("tok", "prefill", "svc-prefill-abc")
    assert members.refusal(SERVICE, "prefill", "svc-prefill-abc", own) is None
    for role, worker in (("prefill", "svc-prefill-xyz"), ("decode", "svc-prefill-abc")):
        refusal = members.refusal(SERVICE, role, worker, own)
        assert refusal is not None and repr(worker) in refusal  # refused by the member claimed
    assert members.refusal("ns/other", "prefill", "svc-prefill-abc", own) is not None  # no token known there
    assert "no member credential" in (members.refusal(SERVICE, "prefill", "svc-prefill-abc", "") or "")
    members.remove(SERVICE)
    assert members.refusal(SERVICE, "prefill", "svc-prefill-abc", own) is not None
    with pytest.raises(ValueError, match="worker id"):
        C.member_credential("tok", "prefill", "")


def test_a_pods_token_is_admitted_only_for_that_pods_name_in_the_services_namespace() -> None:
    pods = {"t-a": PodIdentity("ns", "svc-prefill-abc"), "t-elsewhere": PodIdentity("other", "svc-prefill-abc")}
    members = MemberCredentials()
    assert members.refusal(SERVICE, "prefill", "svc-prefill-abc", "t-a") is not None  # no reviewer: refused
    members.set_review(pods.get)
    assert members.refusal(SERVICE, "prefill", "svc-prefill-abc", "t-a") is None
    assert "svc-prefill-abc" in (members.refusal(SERVICE, "prefill", "svc-prefill-zzz", "t-a") or "")
    assert members.refusal(SERVICE, "prefill", "svc-prefill-abc", "t-elsewhere") is not None
    assert members.refusal(SERVICE, "prefill", "svc-prefill-abc", "t-unknown") is not None


def review(authenticated: bool = True, audiences: list[str] | None = None, **user: Any) -> dict[str, Any]:
    user.setdefault("username", "system:serviceaccount:ns:default")
    user.setdefault("extra", {POD_NAME_EXTRA: ["svc-prefill-abc"]})
    audiences = [E.BROKER_AUDIENCE] if audiences is None else audiences
    return {"status": {"authenticated": authenticated, "audiences": audiences, "user": user}}


def test_a_token_review_names_the_pod_only_for_a_pod_bound_token_of_the_brokers_audience() -> None:
    assert identity_of(review()) == PodIdentity("ns", "svc-prefill-abc")
    assert identity_of(review(authenticated=False)) is None
    assert identity_of(review(audiences=["https://kubernetes.default.svc"])) is None
    assert identity_of(review(extra={})) is None  # not bound to a pod
    assert identity_of(review(username="alice")) is None  # not a service account


class FakeKube:
    def __init__(self, answer: dict[str, Any] | None) -> None:
        self.answer, self.asked = answer, []

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.asked.append(obj)
        if self.answer is None:
            raise KubeError(403, "Forbidden", "tokenreviews is forbidden", "POST", "/apis/authentication.k8s.io")
        return self.answer


def test_the_reviewer_asks_once_per_token_and_a_failed_review_refuses_uncached() -> None:
    now = [0.0]
    kube = FakeKube(review())
    reviewer = TokenReviewer(kube, clock=lambda: now[0])  # type: ignore[arg-type]
    assert reviewer("t") == PodIdentity("ns", "svc-prefill-abc") == reviewer("t")
    assert len(kube.asked) == 1 and kube.asked[0]["spec"] == {"token": "t", "audiences": [E.BROKER_AUDIENCE]}
    now[0] = 61.0
    reviewer("t")
    assert len(kube.asked) == 2  # expired: asked again
    failing = FakeKube(None)
    reviewer = TokenReviewer(failing)  # type: ignore[arg-type]
    assert reviewer("t") is None and reviewer("t") is None and len(failing.asked) == 2


def test_the_secret_and_each_pod_get_what_proves_who_they_are() -> None:
    from pdserve_operator import spec as s
    from pdserve_operator.reconcile.children.meta import Defaults, Owner
    from pdserve_operator.reconcile.children.pod import pod_template

    data = C.secret_data("tok")
    assert data[C.GATEWAY_TOKEN_KEY] == C.gateway_token("tok") and "tok" not in data[C.GATEWAY_TOKEN_KEY]
    assert C.pod_keys("router")[E.EPP_ACCEPT_TOKEN_DIGESTS] == C.ACCEPT_GATEWAY_KEY
    owner = Owner(name="svc", namespace="ns", uid="u")
    spec = s.PDInferenceServiceSpec.model_validate({"model": {"source": "builtin:smollm2"}})
    for role in ("router", "prefill", "decode"):
        pod = pod_template(owner, role, spec, Defaults(image="img", broker_address="op:50050"))["spec"]
        [container] = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        path = env[E.MEMBER_CREDENTIAL_FILE]
        [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        [source] = volume["projected"]["sources"]
        assert source["serviceAccountToken"]["audience"] == E.BROKER_AUDIENCE
        assert path.endswith("/" + source["serviceAccountToken"]["path"])
        assert pod["automountServiceAccountToken"] is False  # no token the API server accepts
