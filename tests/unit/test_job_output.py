"""A background job's shown lines go to its display (``call.show``, from
:data:`nbdist.runtime.output.JOB_DISPLAY`), folded as any call's, summary included; a display that
fails hands the lines back to the stream. The router is driven here as the relay drives it."""
import pytest

from nbdist.runtime import output
from nbdist.runtime.calls import Call

pytestmark = pytest.mark.timeout(30)


def _call():
    return Call(1, "exec", None, [0, 1], None, "job")


def test_a_jobs_lines_go_to_its_display_folded_with_their_summary(monkeypatch, capsys):
    shown = []
    monkeypatch.setattr(output, "JOB_DISPLAY", lambda name: lambda s, t: shown.append((s, t)))
    router, call = output.RankOutput(), _call()
    router.begin(call)
    router.show_job(call, "train")
    for rank in (0, 1):
        router.line(rank, "stdout", "first step done")
    router.tick(1e12)  # past the folding window: the held line is shown
    router.line(0, "stdout", "first step done")  # again: folded, counted in the summary
    router.finish(call, None)
    assert "".join(t for _, t in shown) == ("[ranks 0, 1] first step done\n" + output.HEADER
                                            + "[ranks 0, 1: 3 times] first step done\n")
    assert capsys.readouterr().out == ""  # nothing to the stream


def test_without_a_display_or_with_a_users_sink_lines_go_where_they_went(monkeypatch, capsys):
    monkeypatch.setattr(output, "JOB_DISPLAY", None)
    router, call = output.RankOutput(dedupe=False), _call()
    router.begin(call)
    router.show_job(call, "train")
    router.line(1, "stdout", "hello")
    assert call.show is None and capsys.readouterr().out == "[rank 1] hello\n"
    got = []
    monkeypatch.setattr(output, "JOB_DISPLAY", lambda name: pytest.fail("no display wanted"))
    router = output.RankOutput(user_sink=lambda: lambda r, s, t: got.append(t))
    router.show_job(_call(), "train")  # the user's sink takes the lines: no display


def test_a_failing_display_hands_the_lines_back_to_the_stream(monkeypatch, capfd):
    def broken(stream, text):
        raise RuntimeError("display gone")
    monkeypatch.setattr(output, "JOB_DISPLAY", lambda name: broken)
    router, call = output.RankOutput(dedupe=False), _call()
    router.begin(call)
    router.show_job(call, "train")
    router.line(0, "stdout", "still shown")
    router.line(0, "stdout", "and this")
    out, err = capfd.readouterr()
    assert out == "[rank 0] still shown\n[rank 0] and this\n"
    assert err.count("nbdist: the job's output display failed (RuntimeError('display gone')); "
                     "its lines go to the stream instead") == 1
    assert call.show is None
