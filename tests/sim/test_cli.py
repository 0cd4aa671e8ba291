"""``kvgate sim`` flags: parsing into a SimConfig and refusing bad settings."""

from __future__ import annotations

import argparse
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from kvgate.__main__ import main
from kvgate.sim import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_override_the_profile() -> None:
    cfg = cli.config_from_args(
        parse("--profile", "l4-llama3-8b", "--kv-blocks", "4096", "--on-overflow", "oom")
    )
    assert cfg.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert cfg.kv_blocks == 4096
    assert cfg.context_window == 8192
    assert cfg.on_overflow == "oom"
    assert cfg.kv_bytes_per_token == 131_072


def test_defaults_are_the_tiny_profile() -> None:
    cfg = cli.config_from_args(parse())
    assert (cfg.profile, cfg.kv_blocks, cfg.block_size, cfg.metric_names) == ("tiny", 128, 16, "v1")


def test_invalid_settings_exit_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--kv-blocks", "2", "--port", "0"]) == 2
    assert "larger than the KV cache" in capsys.readouterr().err


def test_unknown_choice_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit):
        parse("--on-overflow", "explode")


def test_port_in_use_is_one_line_and_exit_2() -> None:
    """A taken port: one line naming host:port on stderr, exit 2, no banner, no traceback."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvgate", "sim", "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"kvgate sim: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_banner_names_the_bound_port_and_it_serves() -> None:
    """``--port 0``: the banner (printed after the bind) names the ephemeral port, which answers."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgate", "sim", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        match = re.search(r"on http://127\.0\.0\.1:(\d+) ", banner)
        assert match, banner
        assert "chunked prefill, 2048 tokens per step" in banner
        port = int(match.group(1))
        assert port != 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_chunked_prefill_flags() -> None:
    """Chunked prefill is on with the profile's budget; the flags set the budget or turn it off."""
    assert cli.config_from_args(parse()).token_budget == 2048
    big = cli.config_from_args(parse("--profile", "h800x8-llama3-70b"))
    assert (big.chunked_prefill, big.token_budget) == (True, 8192)
    small = cli.config_from_args(parse("--max-num-batched-tokens", "256"))
    assert (small.chunked_prefill, small.token_budget) == (True, 256)
    whole = cli.config_from_args(parse("--no-chunked-prefill"))
    assert (whole.chunked_prefill, whole.token_budget) == (False, None)
    capped = cli.config_from_args(parse("--no-chunked-prefill", "--max-num-batched-tokens", "4096"))
    assert (capped.chunked_prefill, capped.token_budget) == (False, 4096)


def test_a_budget_below_the_window_without_chunking_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sim", "--no-chunked-prefill", "--max-num-batched-tokens", "512", "--port", "0"]
    assert main(argv) == 2
    assert "smaller than the context window" in capsys.readouterr().err


def test_prefix_caching_flag() -> None:
    assert cli.config_from_args(parse()).prefix_caching is False
    assert cli.config_from_args(parse("--prefix-caching")).prefix_caching is True
