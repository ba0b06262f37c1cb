"""The three launch modes against `LaunchControl` alone: no engine, no subserver. Each test plays the
subservers' side of the protocol by hand: report what is ready, ask `decide`, bracket a step with
`stepping`, take messages."""
from __future__ import annotations

import asyncio

import pytest

from aiorouter.launch import LaunchControl
from aiorouter.request import Handoff, NewRequest, Wake


def wakes(lc: LaunchControl, model: int) -> int:
    return sum(isinstance(m, Wake) for m in lc.take(model))


def test_eager_launches_whatever_is_ready_and_waits_unbounded_otherwise():
    lc = LaunchControl("eager", 2, 8, max_wait_s=0.5)
    lc.set_active(5)
    assert lc.decide(0) == (False, None)  # nothing ready: wait for a message, however long
    lc.set_ready(0, 1)
    assert lc.decide(0).now and not lc.decide(1).now
    with lc.stepping(0):  # another model stepping does not hold eager back
        lc.set_ready(1, 1)
        assert lc.decide(1).now


def test_delayed_waits_for_its_threshold_or_for_every_active_request():
    lc = LaunchControl("delayed", 2, 8, {n: (3, 1) for n in range(1, 9)}, max_wait_s=0.25)
    lc.set_active(5)
    lc.set_ready(0, 2)
    with lc.stepping(1):  # someone steps: no stall, so below B = 3 model 0 waits, at most max_wait
        assert lc.decide(0) == (False, 0.25)
        lc.set_ready(0, 3)
        assert lc.decide(0) == (True, 0.25)
        lc.set_ready(0, 2)
        lc.set_active(2)  # every active request is here: nothing else can arrive, waiting would deadlock
        assert lc.decide(0).now
    assert lc.decide(1) == (False, None)  # nothing ready: no bound on the wait


def test_delayed_stall_kicks_the_model_with_most_ready():
    lc = LaunchControl("delayed", 2, 8, {n: (4, 4) for n in range(1, 9)})
    lc.set_active(8)
    assert wakes(lc, 0) == wakes(lc, 1) == 1  # the active count changed: every model re-decides
    lc.set_ready(0, 1)
    lc.set_ready(1, 2)
    lc.post(0, NewRequest(None))  # a message in flight may still change things: no kick yet
    assert not lc.decide(0).now
    assert [type(m) for m in lc.take(0)] == [NewRequest]
    assert not lc.decide(0).now  # stalled now, but model 1 has more ready: it is kicked and woken
    assert wakes(lc, 1) == 1 and lc.decide(1).now
    with lc.stepping(1):  # the kick is spent once it launches
        pass
    assert not lc.may_launch(1)


def test_sync_rounds_take_the_models_ready_when_they_open_and_wait_for_all_of_them():
    lc = LaunchControl("sync", 3, 8)
    lc.set_active(3)
    lc.set_ready(0, 1)
    lc.set_ready(1, 1)
    lc.post(2, Handoff((), 0))  # in flight: no round opens until it is handled
    assert not lc.decide(0).now
    lc.take(2)
    assert lc.decide(0).now and lc.round == {0, 1}  # the round opens with both ready models
    assert wakes(lc, 1) == 1  # the other member is told
    with lc.stepping(0):
        lc.set_ready(0, 0)
        lc.set_ready(2, 1)
        assert not lc.decide(2).now  # not a member: it waits for the next round
        assert lc.decide(1).now  # a member launches
        with lc.stepping(1):
            lc.set_ready(1, 0)
    assert wakes(lc, 2) == 1  # both members ended: the round is over and the rest are woken
    assert lc.decide(2).now and lc.round == {2}


def test_a_round_member_left_with_nothing_ready_leaves_the_round():
    lc = LaunchControl("sync", 2, 8)
    lc.set_active(2)
    lc.set_ready(0, 1)
    lc.set_ready(1, 1)
    assert lc.decide(0).now and lc.round == {0, 1}
    with lc.stepping(0):
        pass
    lc.take(0)
    lc.set_ready(1, 0)  # its request was aborted before it launched
    assert lc.round == set() and wakes(lc, 0) == 1


async def test_wait_returns_on_a_message_or_at_the_bound():
    lc = LaunchControl("eager", 2, 4)
    assert await lc.wait(0, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, lc.post, 0, Wake())
    assert await asyncio.wait_for(lc.wait(0, None), 5) is True
    assert [type(m) for m in lc.take(0)] == [Wake] and lc.take(0) == []
    lc.post(1, Wake())
    assert await lc.wait(1, 0.0) is True  # a message already waiting: no wait at all


def test_reset_drops_the_inbox_and_what_it_held_in_flight():
    lc = LaunchControl("sync", 2, 4)
    lc.post(0, NewRequest(None))
    lc.post(0, Handoff((), 1))
    lc.set_ready(0, 2)
    assert lc.in_flight == 2
    assert [type(m) for m in lc.reset(0)] == [NewRequest, Handoff]
    assert lc.in_flight == 0 and lc.ready[0] == 0 and lc.take(0) == []


def test_a_schedule_per_concurrency_is_for_delayed_mode_only():
    with pytest.raises(ValueError, match="delayed mode only"):
        LaunchControl("eager", 2, 4).set_schedule({n: (1, 1) for n in range(1, 5)}, {n: "sync" for n in range(1, 5)})
