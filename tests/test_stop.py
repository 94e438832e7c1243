from engine.decoding.stop import StopStringMatcher


def run(stops, pieces):
    m = StopStringMatcher(stops)
    out, stopped = [], False
    for p in pieces:
        text, stopped = m.push(p)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


def test_no_stops_passes_through():
    assert run([], ["ab", "cd"]) == ("abcd", False)


def test_stop_inside_one_piece():
    assert run(["END"], ["hello END world"]) == ("hello ", True)


def test_stop_split_across_pieces_is_never_emitted():
    m = StopStringMatcher(["</s>"])
    assert m.push("abc<") == ("abc", False)
    assert m.push("/") == ("", False)
    assert m.push("s>tail") == ("", True)


def test_partial_match_released_when_it_diverges():
    assert run(["STOP"], ["ST", "OX", "!"]) == ("STOX!", False)


def test_earliest_of_several_stops():
    assert run(["bb", "a"], ["xxbbya"]) == ("xx", True)


def test_held_text_flushed_at_end():
    assert run(["STOP"], ["abc S", "T"]) == ("abc ST", False)
