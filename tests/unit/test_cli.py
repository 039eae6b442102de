"""The command line's shape: one table of commands, each a module of the same shape; one place that turns an
error into its line and exit status; start-up that loads no symbolizer, capture reader or BPF code."""

from __future__ import annotations

import argparse
import pkgutil
import re
import subprocess
import sys

import pytest

from aiflame.cli import commands
from aiflame.cli.main import COMMANDS, build_parser, main
from aiflame.core.errors import AiflameError, BadInput, HostError, InternalError, TargetGone, UsageError
from tests.conftest import REPO


def test_every_listed_command_has_a_module_of_the_one_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    listed = re.findall(r"^    (\S+)", capsys.readouterr().out.split("COMMAND\n", 1)[1], re.M)
    assert listed == [c.NAME for c in COMMANDS]
    for cmd in COMMANDS:
        assert cmd.__name__.startswith("aiflame.cli.commands.")  # type: ignore[attr-defined]
        assert cmd.NAME and cmd.HELP and "\n" not in cmd.HELP
        assert isinstance(cmd.DESCRIPTION, str) and isinstance(cmd.EXAMPLES, str)
        assert not cmd.EXAMPLES or cmd.EXAMPLES.startswith("examples:\n")
        assert callable(cmd.add_arguments) and callable(cmd.run)


def test_every_command_module_is_in_the_table() -> None:
    modules = {m.name for m in pkgutil.iter_modules(commands.__path__)}
    assert modules == {c.__name__.rsplit(".", 1)[1] for c in COMMANDS}  # type: ignore[attr-defined]


@pytest.mark.parametrize("cmd", [c.NAME for c in COMMANDS])
def test_every_command_has_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([cmd, "--help"]) == 0
    assert capsys.readouterr().out.startswith(f"usage: aiflame {cmd}")


def test_usage_errors_are_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nonsense"]) == 2
    assert "invalid choice: 'nonsense'" in capsys.readouterr().err
    assert main([]) == 2  # no command: the help
    assert "COMMAND" in capsys.readouterr().out
    assert main(["profile", "-F", "0", "-p", "1"]) == 2
    assert main(["--version"]) == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["nonsense"], "argument COMMAND: invalid choice: 'nonsense'"),
    (["profile", "-F", "0", "-p", "1"], "-F/--frequency: must be between 1 and 20000 Hz (see 'aiflame profile"),
    (["export"], "the following arguments are required: capture, -f/--format (see 'aiflame export --help')"),
    (["report", "comm"], "required: capture (see 'aiflame report comm --help')"),
    (["chakra", "nope"], "invalid choice: 'nope'"),
    (["status", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_parser_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """README, "Exit status": a usage error is one line (no usage block), status 2."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("aiflame: error: ") and message in err and err.count("\n") == 1
    assert "usage:" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["profile", "-p", "1", "--", "true"], "give either --pid PID or -- CMD, not both"),
    (["profile"], "nothing to profile: give --pid PID, -a (every process) or -- CMD ARGS"),
    (["profile", "-a", "-p", "1"], "-a profiles every process: give it without --pid or a command"),
    (["profile", "-p", "1", "--formats", "folded,gif"], "unknown format 'gif'"),
    (["export", "x.aiflame", "-f", "gif"], "unknown format 'gif' (known: folded, svg,"),
    (["export", "x.aiflame", "-f", "chakra", "--view", "stalls"], "format chakra takes the whole capture (no --view)"),
    (["export", "x.aiflame", "-f", "comm-svg", "--view", "launches"], "format comm-svg takes the whole capture"),
    (["render", "-o", "x.svg"], "give one input, or --diff BEFORE AFTER"),
    (["report", "comm", "x.aiflame", "--threshold", "-1"], "thresholds must be >= 0"),
    (["gpu-symbols", "x", "--kernel", "k"], "--kernel and --offset go together"),
])
def test_misuse_the_parser_cannot_see_is_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiflame: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(("error", "code"), [
    (BadInput("bad [b]input[/b]"), 1), (UsageError("misuse"), 2), (HostError("no BPF"), 3),
    (TargetGone("no such process: 7"), 4), (InternalError("a bug"), 70),
])
def test_an_error_is_one_line_and_its_exit_status(error: AiflameError, code: int, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    class Failing(type(error)):  # type: ignore[misc]
        """A subclass of the kind, as the layers below define theirs."""

    def run(_args: argparse.Namespace) -> int:
        raise Failing(str(error))

    monkeypatch.setattr(commands.doctor, "run", run)
    assert main(["doctor"]) == code
    out, err = capsys.readouterr()
    assert err == f"aiflame: error: {error}\n" and out == ""  # markup in the message is printed as text


@pytest.mark.parametrize(("exc", "code", "err"), [
    (KeyboardInterrupt(), 130, "aiflame: error: interrupted\n"), (BrokenPipeError(), 1, ""),
])
def test_interrupt_and_broken_pipe(exc: BaseException, code: int, err: str, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    def run(_args: argparse.Namespace) -> int:
        raise exc

    monkeypatch.setattr(commands.status, "run", run)
    assert main(["status"]) == code
    assert capsys.readouterr().err == err


def test_other_exceptions_are_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(_args: argparse.Namespace) -> int:
        raise ValueError("a bug")

    monkeypatch.setattr(commands.doctor, "run", run)
    with pytest.raises(ValueError, match="a bug"):  # a traceback, not a line that hides where
        main(["doctor"])


def test_the_command_line_reaches_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[argparse.Namespace] = []

    def run(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(commands.status, "run", run)
    argv = ["status", "--json", "--socket", "/x"]
    assert main(argv) == 0
    [args] = seen
    assert (args.cmd, args.json, args.socket, args.argv) == ("status", True, "/x", argv)


def test_parser_keeps_defaults() -> None:
    args = build_parser().parse_args(["profile", "--", "true"])
    assert (args.frequency, args.formats, args.event, args.gpu_sample_period, args.view) == \
        (99, "folded,svg", "cpu-clock", 20, "cpu")
    args = build_parser().parse_args(["top"])
    assert (args.interval, args.frequency, args.iterations, args.socket) == (2.0, 49, 0, "/run/aiflame/agent.sock")


def test_start_up_loads_no_symbolizer_capture_reader_or_bpf() -> None:
    """`aiflame status` and `--help` stay quick: heavy imports wait for the command that needs them."""
    code = "import sys, aiflame.cli.main; print(' '.join(sorted(sys.modules)))"
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True,
                                text=True).stdout.split())
    heavy = {"aiflame.agent.session", "aiflame.agent.kernel.sampler", "aiflame.symbolize.stacks",
             "aiflame.symbolize.native", "aiflame.core.capture", "aiflame.agent.daemon.server",
             "aiflame.agent.daemon.top", "google.protobuf", "bcc"}
    assert not heavy & loaded


@pytest.mark.parametrize(("text", "ns"), [
    ("2026-11-28T09:00:00Z", 1_795_856_400_000_000_000),
    ("2026-11-28T10:00:00+01:00", 1_795_856_400_000_000_000),
    ("1795856400.5", 1_795_856_400_500_000_000),
])
def test_trigger_at_reads_a_time_every_node_agrees_on(text: str, ns: int) -> None:
    from aiflame.cli.argtypes import wall_time

    assert wall_time(text) == ns


@pytest.mark.parametrize(("text", "why"), [("2026-11-28T09:00:00", "has no time zone"), ("soon", "not a time")])
def test_trigger_at_refuses_a_time_nodes_could_read_differently(text: str, why: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trigger", "--all", "--at", text]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err, err
