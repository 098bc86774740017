"""The ``elche sim`` command: JSON contract, table output, clear errors."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elche import FaultPlan, cli
from elche.cli import _parser, draw_speeds, endings, main
from elche.cli.run import available_mib

CONTRACT = {
    "mode", "world_size", "epochs_completed", "samples_trained", "virtual_wall_s",
    "throughput", "ideal_throughput", "efficiency", "syncs", "lost_samples",
    "duplicated_samples", "dead_ranks", "outcome", "per_rank",
}  # fmt: skip
SMALL = ["--epochs", "1", "--samples", "2000"]


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, object]:
    assert main(["sim", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]  # JSON


def test_json_has_every_contract_key(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, *SMALL)
    assert doc.keys() >= CONTRACT
    assert doc["world_size"] == 3
    assert {"rank", "speed", "samples", "busy_s", "idle_s"} <= doc["per_rank"][0].keys()  # type: ignore[index]


def test_kill_flag_reaches_the_simulation(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, *SMALL, "--kill", "2@0.1")
    assert doc["dead_ranks"] == [2]
    assert doc["lost_samples"] == 0


def test_json_counts_the_stale_messages(capsys: pytest.CaptureFixture[str]) -> None:
    # Rank 2's death abandons round 2: rank 1's failed ack of it comes after the retry opened.
    doc = run_json(capsys, *SMALL, "--mode", "sync", "--kill", "2@0.1")
    assert (doc["rejected_frames"], doc["stale_messages"]) == (0, 1)


def test_kill_at_a_progress_point_and_a_replayed_plan_agree(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    by_flag = run_json(capsys, *SMALL, "--kill", "1@e0.5", "--stall", "2@e0.75")
    assert by_flag["dead_ranks"] == [1, 2]
    plan = FaultPlan().kill(rank=1, at_epoch=0.5).stall(rank=2, at_epoch=0.75)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    replayed = run_json(capsys, *SMALL, "--faults", str(path))
    by_flag.pop("real_s"), replayed.pop("real_s")
    assert replayed == by_flag


def test_demo_takes_a_fault_file_beside_crash_and_stall() -> None:
    args = _parser().parse_args(["demo", "--faults", "p.json", "--crash", "1@1.5"])
    assert (args.faults, args.crash) == ("p.json", ["1@1.5"])


def test_ranks_draw_speeds_from_the_seed(capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(capsys, *SMALL, "--ranks", "5", "--seed", "3")
    speeds = [r["speed"] for r in doc["per_rank"]]  # type: ignore[attr-defined]
    assert speeds == list(draw_speeds(5, 3))
    assert draw_speeds(5, 3) != draw_speeds(5, 4)
    assert all(0.25 <= s <= 1.0 for s in speeds)


def test_async_alias_is_cpu_async(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_json(capsys, *SMALL, "--mode", "async")["mode"] == "cpu-async"


def test_cost_times_every_batch_report_and_round_without_changing_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plain = run_json(capsys, *SMALL)
    timed = run_json(capsys, *SMALL, "--cost")
    cost = timed.pop("coordinator_cost")
    plain.pop("real_s"), timed.pop("real_s")
    assert timed == plain  # timing the coordinator changes none of its decisions
    batches = -(-2000 // 32)  # one epoch, every batch reported once
    assert cost["calls"]["BatchDone"]["count"] == batches  # type: ignore[index]
    assert cost["calls"]["SyncAck"]["count"] == 3 * plain["syncs"]  # type: ignore[index, operator]
    assert cost["batch_report_us"] > 0 and cost["round_us"] > 0  # type: ignore[index, operator]


def test_cost_is_printed_under_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", *SMALL, "--cost"]) == 0
    assert "µs per batch report" in capsys.readouterr().out


def test_table_output_names_the_outcome(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "completed" in out and "efficiency" in out


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--mode", "turbo"], "mode"),
        (["--speeds", "1,0"], "speeds"),
        (["--kill", "one@5"], "kill"),
        (["--kill", "7@1"], "faults"),
        (["--kill", "1@e"], "kill"),
        (["--stall", "1"], "stall"),
        (["--kill", "1@-2"], "at_s"),
        (["--kill", "1@e-2"], "at_epoch"),
        (["--faults", "/nonexistent/plan.json"], "faults"),
        (["--ranks", "2", "--speeds", "1,1,1"], "ranks"),
        (["--batch-size", "0"], "batch_size"),
    ],
)
def test_bad_input_exits_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], args: list[str], field: str
) -> None:
    assert main(["sim", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elche sim: error: {field}:")


def test_bad_mode_lists_the_accepted_values(capsys: pytest.CaptureFixture[str]) -> None:
    main(["sim", "--mode", "turbo"])
    err = capsys.readouterr().err
    for name in ("sync", "cadence", "cpu-sync", "cpu-cadence", "cpu-async"):
        assert name in err


def test_demo_and_run_take_a_dashboard_address() -> None:
    demo = _parser().parse_args(["demo", "--dashboard", "127.0.0.1:0"])
    assert demo.dashboard == "127.0.0.1:0"
    run = _parser().parse_args(["run", "--nproc", "2", "--dashboard", "0", "script.py"])
    assert run.dashboard == "0"


def test_a_bad_dashboard_address_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--nproc", "2", "--dashboard", "nope", "script.py"]) == 2
    assert "dashboard" in capsys.readouterr().err


def test_version_names_elche_torch_and_python(capsys: pytest.CaptureFixture[str]) -> None:
    import platform
    from importlib import metadata

    import elche

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.strip()
    python = platform.python_version()
    assert out == f"elche {elche.__version__} (torch {metadata.version('torch')}, Python {python})"


@pytest.mark.parametrize("command", ["sim", "demo", "compare", "run", "bench", "timeline"])
def test_help_names_every_options_default(capsys: pytest.CaptureFixture[str], command: str) -> None:
    parser = _parser()
    sub = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    )
    options = sub.choices[command]
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    assert "(default: " in capsys.readouterr().out  # the defaults are shown
    for action in options._actions:
        default = action.default
        if not action.option_strings or default in (None, argparse.SUPPRESS) or default is False:
            continue
        if default == []:
            continue
        assert action.help is not None, f"{command} {action.option_strings} has no help"
        assert "default" in options.formatter_class(command)._get_help_string(action), (
            f"{command} {action.option_strings[0]} does not say its default"
        )


def test_every_subcommand_reports_bad_input_in_one_format(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--epochs", "0"]) == 2
    assert capsys.readouterr().err.startswith("elche demo: error: epochs:")
    with pytest.raises(SystemExit):  # argparse's own errors have the same shape
        main(["run", "--nproc"])
    assert capsys.readouterr().err.splitlines()[-1].startswith("elche run: error: ")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["demo", "--ranks", "-1"], "elche demo: error: ranks: must be >= 1, got -1"),
        (["sim", "--faults", "{bin}"], "elche sim: error: faults: {bin} is not a fault plan"),
        (["demo", "--faults", "{bin}"], "elche demo: error: faults: {bin} is not a fault plan"),
        (["chaos", "--dir", "{file}/runs"], "elche chaos: error: dir: cannot make {file}/runs"),
        # It forked until the kernel refused, then hung (refused before any process starts):
        (
            ["run", "--nproc", "99999999999999", "x.py"],
            "elche run: error: nproc: 99999999999999 rank processes do not fit this machine",
        ),
        # Python said it once per rank, then elche run that each rank exited with code 2:
        (
            ["run", "--nproc", "2", "{file}.py"],
            "elche run: error: script: no such file: {file}.py (the Python script that calls",
        ),
        (
            ["join", "tcp://127.0.0.1:1", "--store-port", "1", "{file}.py"],
            "elche join: error: script: no such file: {file}.py",
        ),
    ],
)
def test_bad_input_found_off_the_tested_path_is_one_line_naming_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], said: str
) -> None:
    # Each of these ended in a traceback (or, for --ranks -1, blamed --speeds).
    if args[0] == "run" and available_mib() is None:
        pytest.skip("no /proc/meminfo: elche run cannot tell what fits, and would start them")
    binary, file = tmp_path / "faults.json", tmp_path / "a-file"
    binary.write_bytes(b"\xff\xfe")
    file.write_text("")
    where = {"bin": str(binary), "file": str(file)}
    assert main([arg.format(**where) for arg in args]) == 2
    assert capsys.readouterr().err.startswith(said.format(**where))


def test_elche_run_takes_torchruns_spelling_of_nproc() -> None:
    args = _parser().parse_args(["run", "--nproc-per-node", "3", "train.py", "--lr", "1"])
    assert (args.nproc, args.script, args.script_args) == (3, "train.py", ["--lr", "1"])


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_a_bad_wire_exits_2_naming_the_field_and_the_wires(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    assert main([command, "--wire", "fp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"elche {command}: error: wire:")
    assert "'fp32', 'bf16'" in err


@pytest.mark.parametrize(("stopped", "code"), [("completed", 0), ("coordinator lost", 3)])
@pytest.mark.parametrize("as_json", [False, True])
def test_a_demo_that_joined_a_run_reports_its_rank_not_a_failed_run(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    stopped: str,
    code: int,
    as_json: bool,
) -> None:
    # Under `elche join ... elche demo`, elche.train returns the joined rank's own summary.
    joined = {"joined_as": 3, "stopped": stopped, "samples": 640, "speed": 1.0}
    monkeypatch.setattr(cli, "_demo_summary", lambda **_: joined)
    assert main(["demo", "--no-progress", *(["--json"] if as_json else [])]) == code
    captured = capsys.readouterr()
    assert "the run failed" not in captured.err
    if as_json:
        assert json.loads(captured.out) == joined
    else:
        assert f"joined the run as rank 3, trained 640 samples, stopped: {stopped}" in captured.out


def _refuse_to_run(*args: object, **kwargs: object) -> object:
    raise AssertionError("bad input must be refused before anything runs")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        # Each ran (a bench suite for minutes, ten chaos runs, a demo's training) before it
        # failed, or blamed a flag the user did not give, or was silently accepted.
        (["bench", "--out", "{file}/x"], "elche bench: error: out: cannot write in {file}/x"),
        (["chaos", "--bound", "-5"], "elche chaos: error: bound: must be a finite number"),
        (["chaos", "--bound", "0"], "elche chaos: error: bound: must be a finite number"),
        (["demo", "--speeds", ","], "elche demo: error: speeds: needs one speed per rank"),
        (["compare", "--speeds", ","], "elche compare: error: speeds: needs one speed per rank"),
        (["sim", "--speeds", ","], "elche sim: error: speeds: needs one speed per rank"),
        (["sim", "--base-ms", "0"], "elche sim: error: base_ms: must be a finite number > 0"),
        (["sim", "--base-ms", "-1"], "elche sim: error: base_ms: must be a finite number > 0"),
        # A run past the simulator's virtual limit ran for hours (every rank's heartbeat
        # simulated each virtual second), silently, and then failed.
        (["sim", "--base-ms", "1e12"], "elche sim: error: base_ms: a step lasts 1e+09 virtual"),
        (
            ["sim", "--speeds", "1,1e-10"],
            "elche sim: error: speeds: a step at speed 1e-10 lasts 1e+08 virtual s",
        ),
        (
            ["sim", "--epochs", "100000000"],
            "elche sim: error: epochs: 100000000 epoch(s) of 30000 samples in steps of 32, "
            "10 ms each at speed 1, take at least 5.36e+08 virtual s",
        ),
        (
            ["sim", "--samples", "1000000000000"],
            "elche sim: error: epochs: 3 epoch(s) of 1000000000000 samples",
        ),
        (
            ["sim", "--kill", "1@e99"],
            "elche sim: error: kill: 1@e99 is at epoch 99, and the run",
        ),
        (
            ["sim", "--stall", "1@e3"],
            "elche sim: error: stall: 1@e3 is at epoch 3, and the run",
        ),
        (
            ["demo", "--epochs", "2", "--crash", "1@2.5"],
            "elche demo: error: crash: 1@2.5 is at epoch 2.5, and the run ends at epoch 2",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_runs_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    args: list[str],
    said: str,
) -> None:
    import elche.bench
    import elche.chaos

    for target, name in ((elche.bench, "run_bench"), (elche.chaos, "run_chaos")):
        monkeypatch.setattr(target, name, _refuse_to_run)
    monkeypatch.setattr(cli, "_demo_summary", _refuse_to_run)
    file = tmp_path / "a-file"
    file.write_text("")
    assert main([arg.format(file=file) for arg in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said.format(file=file)) and err.count("\n") == 1


def test_bench_refuses_an_out_under_proc(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import elche.bench

    if not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    monkeypatch.setattr(elche.bench, "run_bench", _refuse_to_run)
    assert main(["bench", "--out", "/proc/elche-bench"]) == 2
    assert capsys.readouterr().err.startswith("elche bench: error: out: cannot write in /proc/")


def test_run_bench_makes_its_out_dir_before_the_suite_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import elche.bench.runner
    from elche.bench import SUITES, run_bench
    from elche.core.errors import ConfigError

    monkeypatch.setattr(elche.bench.runner, "run_suite", _refuse_to_run)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError) as info:
        run_bench(SUITES["quick"], tmp_path / "a-file" / "out", command="test", progress=False)
    assert info.value.field == "out_dir"


def test_a_fault_files_point_past_the_runs_end_is_warned_of(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A replayed plan may hold one (it is the flags that are refused).
    path = tmp_path / "plan.json"
    path.write_text(FaultPlan().kill(rank=1, at_epoch=5.0).to_json())
    assert main(["sim", *SMALL, "--faults", str(path)]) == 0
    assert "is at epoch 5, and the run ends at epoch 1: it will not fire" in capsys.readouterr().err


def test_run_chaos_refuses_a_bound_that_every_run_would_break(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import elche.chaos
    from elche.core.errors import ConfigError

    monkeypatch.setattr(elche.chaos, "_one", _refuse_to_run)
    with pytest.raises(ConfigError) as info:
        elche.chaos.run_chaos(runs=1, seed=0, mode="cadence", workdir=tmp_path, bound_s=0.0)
    assert info.value.field == "bound_s"


def test_demo_refuses_a_save_path_that_is_a_directory(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Its bundle went to siblings DIR.*, and DIR.lock was left beside it.
    assert main(["demo", "--epochs", "1", "--save-path", str(tmp_path), "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith(
        f"elche demo: error: save_path: is a bundle stem, not a directory: got '{tmp_path}'"
    )
    assert not Path(f"{tmp_path}.lock").exists()


@pytest.mark.parametrize(("name", "code"), [("SIGINT", 130), ("SIGTERM", 143)])
@pytest.mark.parametrize("command", ["demo", "compare"])
def test_a_signal_in_start_up_is_one_line_and_the_shells_status(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    name: str,
    code: int,
) -> None:
    # Ctrl-C while torch imported ended in a 20-line traceback and status -2.
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt if name == "SIGINT" else endings.Terminated  # SIGTERM's, in main

    monkeypatch.setattr(cli, "_demo_summary", interrupted)
    monkeypatch.setattr("elche.bench.runner.measure_speed_base_s", interrupted)
    try:
        status = main([command, "--no-progress"] if command == "demo" else [command])
    except KeyboardInterrupt:  # (raised on, it would end this test session)
        pytest.fail("the interrupt escaped main: a traceback and status -2")
    assert status == code
    assert capsys.readouterr().err == f"elche {command}: interrupted by {name}\n"


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGHUP", 129)])
@pytest.mark.parametrize("command", ["demo", "compare"])
def test_sigterm_or_sighup_unwinds_like_ctrl_c_with_the_shells_status(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
    name: str,
    code: int,
) -> None:
    # SIGHUP (a closed terminal, a dropped ssh) was left to its default: it ended the
    # command there and then, a baseline's ranks and files left behind.
    import os
    import signal

    cleaned = []
    signum = signal.Signals[name]

    def start_up(*args: object, **kwargs: object) -> None:
        try:
            os.kill(os.getpid(), signum)  # its handler raises here, inside the try
        finally:
            cleaned.append(True)

    def not_main(signum: int, frame: object) -> None:
        raise AssertionError("main left the signal to its old handler (the default kills)")

    monkeypatch.setattr(cli, "_demo_summary", start_up)
    monkeypatch.setattr("elche.bench.runner.measure_speed_base_s", start_up)
    previous = signal.signal(signum, not_main)
    try:
        assert main([command, "--no-progress"] if command == "demo" else [command]) == code
        assert signal.getsignal(signum) is not_main  # restored
    finally:
        signal.signal(signum, previous)
    assert cleaned == [True]
    assert capsys.readouterr().err == f"elche {command}: interrupted by {name}\n"


def test_a_sighup_ignored_under_nohup_stays_ignored(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import signal

    handlers = []

    def start_up(**kwargs: object) -> dict[str, object]:
        handlers.append(signal.getsignal(signal.SIGHUP))
        os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
        return {"joined_as": 1}

    monkeypatch.setattr(cli, "_demo_summary", start_up)
    monkeypatch.setattr(cli, "_joined_demo", lambda summary, as_json: 0)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert main(["demo", "--no-progress"]) == 0
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert handlers == [signal.SIG_IGN]
    assert capsys.readouterr().err == ""


def test_a_run_that_said_where_it_stopped_is_not_said_again(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    from elche.runtime.lifetimes import Interrupted

    def stopped(*args: object, **kwargs: object) -> None:
        raise Interrupted(signal.SIGTERM, "/tmp/bundle")

    monkeypatch.setattr("elche.bench.runner.measure_speed_base_s", lambda *a: 0.01)
    monkeypatch.setattr("elche.baselines.ddp.run_ddp", stopped)
    assert main(["compare"]) == 143
    assert capsys.readouterr().err == ""


@pytest.mark.slow
@pytest.mark.integration
def test_a_closed_stdout_ends_the_command_quietly(tmp_path: Path) -> None:
    # `elche timeline RUN | head -1` ended in a BrokenPipeError traceback, status 1.
    import os
    import subprocess
    import sys

    _timeline(tmp_path, ['{"kind":"EpochStart","epoch":0,"t":0.1}'] * 3)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    try:
        done = subprocess.run(
            [sys.executable, "-m", "elche.cli", "timeline", str(tmp_path)],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (141, "")


def _timeline(run_dir: Path, lines: list[str]) -> None:
    (run_dir / "timeline.jsonl").write_text("".join(line + "\n" for line in lines))


def test_timeline_says_how_many_lines_it_skipped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = '{"kind":"EpochStart","epoch":0,"t":0.1}'
    _timeline(tmp_path, [good, "not json", '{"kind":"NoSuchRecord","t":1}', good])
    with (tmp_path / "timeline.jsonl").open("a") as fh:
        fh.write('{"kind":"EpochEnd","ep')  # a last line cut short
    assert main(["timeline", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("EpochStart") == 2
    assert captured.err.startswith(
        f"elche timeline: skipped 3 unreadable lines of {tmp_path / 'timeline.jsonl'}"
    )


def test_timeline_of_no_readable_record_is_bad_input(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A binary file printed nothing with status 0.
    (tmp_path / "timeline.jsonl").write_bytes(b"\x00\xff\xfe garbage\n\x89PNG\r\n")
    assert main(["timeline", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(
        f"elche timeline: error: run_dir: {tmp_path / 'timeline.jsonl'} holds no timeline "
        "record: 2 unreadable lines"
    )


def test_elche_run_leaves_no_run_directory_where_no_run_began(tmp_path: Path) -> None:
    # It left an empty /tmp/elche-run-* for a bad flag and for a script that never trained.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    script = tmp_path / "plain.py"
    script.write_text("print('no training here')\n")
    env = {k: v for k, v in os.environ.items() if k != "ELCHE_RUN_DIR"}
    env["TMPDIR"] = str(scratch)
    run = [sys.executable, "-m", "elche.cli", "run", "--nproc", "2"]
    done = subprocess.run([*run, str(script)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("no training here") == 2
    bad = subprocess.run([*run, "--dashboard", "abc", str(script)], env=env, capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert bad.returncode == 2 and "dashboard" in bad.stderr
    assert list(scratch.iterdir()) == []


def test_a_long_simulation_shows_its_epochs_and_virtual_time() -> None:
    # A simulation that ran for minutes (thousands of ranks, a long run) showed
    # nothing until it ended. Past SHOW_AFTER_S it draws the epochs ended so far.
    from elche.cli.sim import SHOW_AFTER_S, SimProgress
    from elche.sim.engine import SimConfig, Simulation

    clock = iter([0.0, 0.5, *[SHOW_AFTER_S] * 10_000])  # made; one early tick; then late
    progress = SimProgress(3, enabled=True, clock=lambda: next(clock))
    shown: list[tuple[float, str] | None] = []

    def tick(sim: Simulation) -> None:
        progress(sim)
        task = progress.display.bar.tasks[0] if progress.display else None
        shown.append(None if task is None else (task.completed, task.description))

    config = SimConfig(speeds=(1.0, 0.5, 0.25), epochs=3, samples=3000)
    try:
        Simulation(config).run(tick=tick, every=20)
    finally:
        progress.close()
    assert shown[0] is None  # the first half second: nothing drawn
    drawn = [x for x in shown[1:] if x is not None]
    assert len(drawn) == len(shown) - 1 >= 10
    epochs = [completed for completed, _ in drawn]
    assert epochs == sorted(epochs) and epochs[0] == 0 and epochs[-1] >= 2, epochs
    times = [float(text.split(", ")[1].split()[0].replace(",", "")) for _, text in drawn]
    assert times == sorted(times) and times[-1] > times[0], times
    assert all(text.startswith("simulating, ") for _, text in drawn)


def test_a_simulation_shows_no_progress_where_it_is_not_enabled() -> None:
    from elche.cli.sim import SimProgress
    from elche.sim.engine import SimConfig, Simulation

    progress = SimProgress(1, enabled=False, clock=lambda: 1e9)
    Simulation(SimConfig(speeds=(1.0, 0.5), epochs=1, samples=2000)).run(tick=progress, every=5)
    assert progress.display is None
