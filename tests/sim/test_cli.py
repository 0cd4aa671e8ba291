"""``kvgate sim`` flags: parsing into a SimConfig and refusing bad settings."""

from __future__ import annotations

import argparse

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
