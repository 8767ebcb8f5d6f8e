"""n copies of a prompt share the first copy's prompt blocks on its decode (issue #31 item 2):
the first copy's Reserve says how many copies follow (its decode keeps the blocks for them),
the router asks that decode first for the later copies, with `share_from` naming the first
copy's reservation, and asks every other decode plainly (they do not hold that KV)."""

from __future__ import annotations

import asyncio

from pdserve.v1 import worker_pb2
from pdserve_common.membership import Load, Member, MemberInfo, Role
from pdserve_worker.api import prompt_copies
from pdserve_worker.router.grants import sharing_first


def members(*ids: str) -> list[Member]:
    return [Member(MemberInfo(worker_id=i, role=Role.DECODE, revision="r1"), load=Load()) for i in ids]


def plain() -> worker_pb2.ReserveRequest:
    return worker_pb2.ReserveRequest(request_id="r-1", num_prompt_tokens=40, max_tokens=8, lease_ms=500)


def in_copy(first: bool, copies: prompt_copies.Copies, fn):
    """Run `fn` in a task serving one copy (the group is the task's context)."""

    async def serve():
        prompt_copies.enter(copies, first)
        return fn()

    return asyncio.run(serve())


def test_a_later_copy_asks_the_first_copys_decode_first_to_share() -> None:
    copies = prompt_copies.Copies()
    in_copy(True, copies, lambda: prompt_copies.note_decode("decode-1", 3, 77))
    assert copies.decode == ("decode-1", 3, 77)
    ranked, sharing = in_copy(False, copies, lambda: sharing_first(members("decode-0", "decode-1"), plain()))
    assert [m.worker_id for m in ranked] == ["decode-1", "decode-0"]
    assert sharing is not None and sharing.HasField("share_from")
    assert (sharing.share_from.slot, sharing.share_from.generation) == (3, 77)
    assert (sharing.request_id, sharing.num_prompt_tokens, sharing.max_tokens) == ("r-1", 40, 8)


def test_no_sharing_without_a_first_copy_or_its_decode() -> None:
    copies = prompt_copies.Copies()
    ranked = members("decode-0", "decode-1")
    # The first copy itself, and a request that is no copy at all, reserve plainly.
    in_copy(True, copies, lambda: prompt_copies.note_decode("decode-1", 3, 77))
    assert in_copy(True, copies, lambda: sharing_first(ranked, plain())) == (ranked, None)
    assert sharing_first(ranked, plain()) == (ranked, None)
    # The first copy's decode failed this request or left: the others are asked plainly.
    assert in_copy(False, copies, lambda: sharing_first(members("decode-0"), plain()))[1] is None
    # Only the first copy names the decode.
    later = prompt_copies.Copies()
    in_copy(False, later, lambda: prompt_copies.note_decode("decode-0", 1, 5))
    assert later.decode is None


def test_only_the_first_copy_says_how_many_follow() -> None:
    copies = prompt_copies.Copies(later=2)
    assert in_copy(True, copies, prompt_copies.later_copies) == 2
    assert in_copy(False, copies, prompt_copies.later_copies) == 0
    assert prompt_copies.later_copies() == 0  # a request that is no copy
