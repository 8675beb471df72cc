"""Progress of long work (issue #17): the run's bar under its live counters, the sweep's budget bar over its step
bar, plain lines off a terminal. The plain lines are checked exactly on a fake clock; the terminal rendering
through rich's own console with ``force_terminal=True`` (so dropping the bar from the view fails here)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from paasbench.load.live import LiveView, Progress
from paasbench.progress import Display, Stage, hms, line
from paasbench.sweep.view import SweepView


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def sweep_view(console: Console, budget_s: float, most_steps: int) -> tuple[SweepView, FakeClock]:
    clock = FakeClock(0.0)
    return SweepView(console, budget_s=budget_s, most_steps=most_steps, clock=clock, every_s=10.0), clock


def plain_console() -> Console:
    return Console(file=io.StringIO(), width=200)          # not a terminal: a pipe, a CI log


def tty_console() -> Console:
    return Console(file=io.StringIO(), width=160, force_terminal=True, color_system="standard", highlight=False)


def test_stage_eta_and_line():
    assert hms(None) == "-:--" and hms(65) == "1:05" and hms(3723) == "1:02:03"
    st = Stage("run", 120, 600, "requests", 12.0)
    assert st.eta_s == pytest.approx(48.0)            # the rate so far: 10 requests/s, 480 to go
    assert line(st) == "run: 120/600 requests (20%), elapsed 0:12, ETA 0:48"
    assert Stage("run", 0, 600, elapsed_s=3.0).eta_s is None
    timed = Stage("run", 12.0, 600.0, "s", 12.0, "warm-up")
    assert line(timed) == "run [warm-up]: 0:12 of 10:00 (2%), elapsed 0:12, ETA 9:48"


def test_run_plain_lines_exact_and_no_control_characters():
    clock = FakeClock(100.0)
    p = Progress(planned=600, started=100.0, warmup_s=5.0)
    console = plain_console()
    view = LiveView(p, console, clock=clock, every_s=10.0)
    with view:                                         # first line at once
        clock.t = 103.0
        view._display.lines.tick(view._display.stages())   # 3 s later: nothing (every 10 s)
        p.done, p.sent = 100, 110
        clock.t = 110.0
        view._display.lines.tick(view._display.stages())
        p.done, p.sent = 600, 600
        clock.t = 160.0
    out = console.file.getvalue()
    assert out.startswith("run [warm-up]: 0/600 requests (0%), elapsed 0:00, ETA -:--\n"
                          "run: 100/600 requests (17%), elapsed 0:10, ETA 0:50\n"
                          "run: 600/600 requests (100%), elapsed 1:00, ETA 0:00\n")
    assert out.splitlines()[3].strip() == "paasbench run"             # then the final counters, once
    assert out.endswith("\n") and "output TPM" in out.splitlines()[-1]   # the last line ends too
    assert "\x1b" not in out and "\r" not in out


def test_run_no_live_on_a_terminal_is_plain_lines_too():
    clock = FakeClock(0.0)
    console = tty_console()
    with LiveView(Progress(started=0.0, duration_s=600.0, warmup_s=30.0), console, live=False, clock=clock):
        clock.t = 45.0
    out = console.file.getvalue()
    assert out.startswith("run [warm-up]: 0:00 of 10:00 (0%), elapsed 0:00, ETA 10:00\n"
                          "run: 0:45 of 10:00 (8%), elapsed 0:45, ETA 9:15\n")
    assert "━" not in out and "\x1b[?25l" not in out       # no bar, no live view's cursor control


def test_run_terminal_view_has_counters_and_a_bar():
    clock = FakeClock(12.0)
    p = Progress(planned=600, started=0.0, warmup_s=30.0)
    p.done, p.sent = 120, 130
    console = tty_console()
    with LiveView(p, console, clock=clock):
        pass
    out = console.file.getvalue()
    assert "\x1b[" in out                              # drawn by rich's live view
    assert "done" in out and "output TPM" in out       # the counters stay
    assert "━" in out                                  # the bar is drawn under them
    assert "warm-up" in out and "120/600 requests" in out and "ETA 0:48" in out


def test_several_workers_show_one_bar():
    from paasbench.load.fleet import Fleet

    class Writer:
        def write(self, rec): pass

    p = Progress(started=0.0)
    fleet = Fleet(3, Writer(), p, None, on_abort=lambda: None)   # type: ignore[arg-type]
    for w, n in enumerate((100, 100, 50)):
        fleet.deliver(w, "Y", {"planned": n})
    console = tty_console()
    with LiveView(p, console, clock=FakeClock(1.0)):
        pass
    assert console.file.getvalue().count("0/250 requests") == 1


def test_sweep_plain_lines_exact_with_a_github_group(monkeypatch):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    console = plain_console()
    view, clock = sweep_view(console, 1800.0, 11)
    with view:
        clock.t = 41.0
        with view.step(3, "escalate", "rate=0.2 req/s", warmup_s=30.0, duration_s=120.0):
            clock.t = 51.0
            view.display.lines.tick(view.stages())
            clock.t = 195.0
        console.print("step 003 escalate rate=0.2 req/s  PASS")   # the driver's line, outside the fold
        clock.t = 200.0
    assert console.file.getvalue() == (
        "sweep: 0:00 of 30:00 (0%), elapsed 0:00, left 30:00\n"
        "::group::step 003 escalate rate=0.2 req/s\n"
        "sweep [escalate] step 1 of at most 11 · rate=0.2 req/s: 0:41 of 30:00 (2%), elapsed 0:41, left 29:19\n"
        "step 003 [warm-up]: 0:00 of 2:30 (0%), elapsed 0:00, ETA 2:30\n"
        "sweep [escalate] step 1 of at most 11 · rate=0.2 req/s: 0:51 of 30:00 (3%), elapsed 0:51, left 29:09\n"
        "step 003 [warm-up]: 0:10 of 2:30 (7%), elapsed 0:10, ETA 2:20\n"
        "::endgroup::\n"
        "step 003 escalate rate=0.2 req/s  PASS\n"
        "sweep step 1 of at most 11: 3:20 of 30:00 (11%), elapsed 3:20, left 26:40\n")


def test_sweep_no_group_outside_github(monkeypatch):
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    console = plain_console()
    view, _ = sweep_view(console, 60.0, 2)
    with view, view.step(0, "escalate", "rate=1 req/s", warmup_s=1.0, duration_s=2.0):
        pass
    assert "::group::" not in console.file.getvalue()


def test_sweep_terminal_shows_the_budget_bar_over_the_step_bar_and_step_lines_above():
    console = tty_console()
    view, clock = sweep_view(console, 1800.0, 11)
    with view:
        clock.t = 41.0
        with view.step(3, "bisect", "rate=0.3 req/s", warmup_s=30.0, duration_s=120.0):
            clock.t = 81.0
            console.print("step 002 escalate rate=0.4 req/s  FAIL")
            rendered = tty_console()
            rendered.print(view.display.renderable())
    out = rendered.file.getvalue()
    assert out.index("sweep") < out.index("step 003")   # the outer bar first, the step's inside it
    assert "bisect" in out and "step 1 of at most 11" in out and "rate=0.3 req/s" in out
    assert "1:21 of 30:00" in out and "left 28:39" in out and "0:40 of 2:30" in out and "measuring" in out
    assert out.count("━") > 20
    live = console.file.getvalue()                    # the finished step's line is printed above the bars
    assert live.index("step 002 escalate rate=0.4 req/s  FAIL") < live.rindex("left 28:39")


def test_waiting_shows_elapsed_with_no_end():
    console = plain_console()
    view, clock = sweep_view(console, 600.0, 3)
    with view:
        clock.t = 2.0
        with view.waiting("starting the embedded server"):
            clock.t = 14.0
            view.display.lines.tick(view.stages())
    assert ("starting the embedded server: elapsed 0:12\n"
            in console.file.getvalue())


def test_display_plain_thread_stops_and_ends_with_a_line():
    console = plain_console()
    with Display(lambda: [Stage("trace gen", 5, 10)], console, every_s=0.01):
        pass
    assert console.file.getvalue().endswith("trace gen: 5/10 requests (50%), elapsed 0:00, ETA 0:00\n")


def test_counting_is_silent_for_quick_work_and_reports_long_work():
    from paasbench.progress import counting

    clock = FakeClock(0.0)
    console = plain_console()
    with counting("calibrate", console, unit="engine steps", clock=clock, after_s=3.0) as counter:
        counter(10, 40)
        clock.t = 1.0
    assert console.file.getvalue() == ""                       # under 3 s: nothing said
    with counting("trace gen", console, clock=clock, after_s=3.0) as counter:
        counter(0, None, "writing 300,000 requests")
        clock.t = 5.0
    assert console.file.getvalue() == "trace gen [writing 300,000 requests]: elapsed 0:04\n"


def test_calibration_reports_every_engine_step():
    from reference_server.engine.cpu import CpuEngine
    from reference_server.sim.calibrate import BLOCK, measure

    seen: list[tuple[int, int]] = []
    engine = CpuEngine(block_size=BLOCK, num_blocks=64, model="tiny", seed=0)
    measure(engine, [[(8, 0)], [(16, 0)]], repeats=2, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(i, 6) for i in range(1, 7)]


def test_run_command_off_a_terminal_prints_plain_progress_lines(tmp_path):
    from pathlib import Path

    from click.testing import CliRunner
    from sse_server import SSEServer

    from paasbench.cli import main

    trace = Path(__file__).parent / "fixtures" / "run" / "faults.jsonl"
    with SSEServer(ttft_ms=5, itl_ms=2) as srv:
        res = CliRunner().invoke(main, ["run", "--target", srv.url, "--trace", str(trace), "--out",
                                        str(tmp_path / "r"), "--concurrency", "2", "--max-requests", "3",
                                        "--no-scrape-metrics"])
    assert res.exit_code == 0, res.output
    assert "run: 3/3 requests (100%), elapsed " in res.output      # the run's last progress line
    assert "\x1b" not in res.output and "╺" not in res.output      # no bars, no control characters
