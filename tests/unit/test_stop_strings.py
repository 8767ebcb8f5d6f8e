from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_worker.roles.stop_strings import StopStringCutter


def run(pieces, stops):
    """Feed pieces; return (what was released step by step, final text, stopped)."""
    cutter = StopStringCutter(stops)
    released = []
    for piece in pieces:
        released.append(cutter.feed(piece))
        if cutter.stopped:
            break
    if not cutter.stopped:
        released.append(cutter.flush())
    return released, "".join(released), cutter.stopped


def expected_cut(text, stops):
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def test_stop_split_across_tokens_is_cut_and_never_shown():
    released, text, stopped = run(["Hello", " Us", "er", ": more"], ["User:"])
    assert stopped and text == "Hello "
    assert released[:3] == ["Hello", " ", ""]  # "Us" and "er" held back: they may begin "User:"


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    released, text, stopped = run(["ab", "c", "x"], ["abcd"])
    assert not stopped and text == "abcx"
    assert released == ["", "", "abcx", ""]


def test_earliest_of_several_stops_wins():
    _, text, _ = run(["one two three"], ["three", "two"])
    assert text == "one "


def test_without_stops_text_passes_through_at_once():
    released, text, stopped = run(["a", "b"], [])
    assert released == ["a", "b", ""] and not stopped


def test_empty_stop_string_is_refused():
    try:
        StopStringCutter(["ok", ""])
    except ValueError as exc:
        assert "non-empty" in str(exc)
    else:
        raise AssertionError("an empty stop string would cut everything; it must be refused")


alphabet = st.sampled_from("abc \n")


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text(alphabet, max_size=4), max_size=12),
       stops=st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3))
def test_stream_equals_cut_of_whole_text_and_never_runs_ahead(pieces, stops):
    released, text, stopped = run(pieces, stops)
    whole = "".join(pieces)
    want, want_stopped = expected_cut(whole, stops)
    assert (text, stopped) == (want, want_stopped)
    # Every prefix of the stream is a prefix of the final answer: nothing shown is retracted.
    shown = ""
    for part in released:
        shown += part
        assert want.startswith(shown)
