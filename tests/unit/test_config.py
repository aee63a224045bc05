"""Tests for coordinator.config: loading the TOML tree, `--set` overrides and error messages.

The module promises errors that name the dotted key and, for a value from the file, its line;
most tests here check both, since an operator fixes a bad config from the message alone.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from coordinator.config import (
    MIB,
    AuthConfig,
    ConfigError,
    CoordinatorConfig,
    LimitsConfig,
    OuterConfig,
    describe,
    load,
    parse_overrides,
)
from coordinator.policy import PolicyConfig

FULL = """\
listen = "0.0.0.0:6000"
state_dir = "/var/lib/ftsync"
fsync = false
heartbeat_interval_ms = 250

[policy]
min_quorum = 3
gamma = 0.25
merge = "rda"
max_staleness = 4

[outer]
lr = 0.5
momentum = 0.8
nesterov = false

[limits]
norm_bound = 100
chunk_bytes = 1048576

[auth.tokens]
alice = "secret-alice"
bob = "secret-bob"
"""


def write(tmp_path: Path, text: str, name: str = "ftsync.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path: Path, text: str, overrides: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(CoordinatorConfig, write(tmp_path, text), overrides)
    return str(info.value)


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line of `text` containing `needle`."""
    for number, line in enumerate(textwrap.dedent(text).splitlines(), start=1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in the text")


# -- loading ---------------------------------------------------------------------------------


def test_full_file_loads_into_the_frozen_tree(tmp_path: Path) -> None:
    config = load(CoordinatorConfig, write(tmp_path, FULL))
    assert config.listen == "0.0.0.0:6000"
    assert config.state_dir == "/var/lib/ftsync"
    assert config.fsync is False
    assert config.heartbeat_interval_ms == 250
    assert config.policy == PolicyConfig(min_quorum=3, gamma=0.25, merge="rda", max_staleness=4)
    assert config.outer == OuterConfig(lr=0.5, momentum=0.8, nesterov=False)
    assert config.limits == LimitsConfig(norm_bound=100.0, chunk_bytes=MIB)
    # An integer written for a float field arrives as a float.
    assert isinstance(config.limits.norm_bound, float)
    assert config.auth == AuthConfig(tokens={"alice": "secret-alice", "bob": "secret-bob"})
    assert config.tokens() == {"alice": "secret-alice", "bob": "secret-bob"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.listen = "127.0.0.1:1"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.policy.min_quorum = 1  # type: ignore[misc]


def test_no_file_and_empty_file_give_the_defaults(tmp_path: Path) -> None:
    assert load(CoordinatorConfig) == CoordinatorConfig()
    assert load(CoordinatorConfig, write(tmp_path, "")) == CoordinatorConfig()


def test_tables_left_out_keep_their_defaults(tmp_path: Path) -> None:
    config = load(CoordinatorConfig, write(tmp_path, "[policy]\nmin_quorum = 2\n"))
    assert config.policy == PolicyConfig(min_quorum=2)
    assert config.outer == OuterConfig()
    assert config.limits == LimitsConfig()


def test_dotted_keys_in_the_file(tmp_path: Path) -> None:
    config = load(CoordinatorConfig, write(tmp_path, "policy.min_quorum = 5\nouter.lr = 0.1\n"))
    assert config.policy.min_quorum == 5
    assert config.outer.lr == 0.1


# -- overrides -------------------------------------------------------------------------------


def test_parse_overrides() -> None:
    assert parse_overrides([]) == {}
    assert parse_overrides(["policy.min_quorum=3", " listen = 0.0.0.0:1 ", "a.b=x=y"]) == {
        "policy.min_quorum": "3", "listen": "0.0.0.0:1", "a.b": "x=y"}
    # The last of repeated flags wins.
    assert parse_overrides(["fsync=true", "fsync=false"]) == {"fsync": "false"}


@pytest.mark.parametrize("pair", ["policy.min_quorum", "=3", " =3", ""])
def test_parse_overrides_rejects_pairs_without_key_or_equals(pair: str) -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides([pair])


def test_overrides_win_over_the_file(tmp_path: Path) -> None:
    overrides = parse_overrides([
        "policy.min_quorum=7",        # TOML integer
        "policy.gamma=0.75",          # TOML float
        "fsync=true",                 # TOML bool
        'policy.merge="mean"',        # TOML string
        "listen=10.0.0.1:7000",       # not TOML: taken as a bare string
        "state_dir=/tmp/run state",   # bare string with a space
        "outer.momentum=0",           # int for a float field
        "auth.tokens.carol=c-token",  # adds to a table from the file
    ])
    config = load(CoordinatorConfig, write(tmp_path, FULL), overrides)
    assert config.policy.min_quorum == 7
    assert config.policy.gamma == 0.75
    assert config.fsync is True
    assert config.policy.merge == "mean"
    assert config.listen == "10.0.0.1:7000"
    assert config.state_dir == "/tmp/run state"
    assert config.outer.momentum == 0.0 and isinstance(config.outer.momentum, float)
    # Keys of the file that no override touched stay as written.
    assert config.outer.lr == 0.5
    assert config.policy.max_staleness == 4
    assert config.tokens() == {"alice": "secret-alice", "bob": "secret-bob", "carol": "c-token"}


def test_overrides_without_a_file(tmp_path: Path) -> None:
    config = load(CoordinatorConfig, None, {"limits.chunk_bytes": str(4 * MIB),
                                            "metrics.prometheus_listen": '"0.0.0.0:9100"'})
    assert config.limits.chunk_bytes == 4 * MIB
    assert config.metrics.prometheus_address() == ("0.0.0.0", 9100)


@pytest.mark.parametrize(("listen", "address"), [
    ("9464", ("127.0.0.1", 9464)),  # a bare port stays on loopback
    ("localhost:9464", ("localhost", 9464)),
    ("0.0.0.0:0", ("0.0.0.0", 0)),
    ("[::1]:9464", ("::1", 9464)),
])
def test_the_prometheus_listen_address(listen: str, address: tuple[str, int]) -> None:
    config = load(CoordinatorConfig, None, {"metrics.prometheus_listen": f'"{listen}"'})
    assert config.metrics.prometheus_address() == address


@pytest.mark.parametrize("listen", [":9464", "host:", "host:99999", "host:port", "a b:1"])
def test_a_bad_prometheus_listen_address_is_named(listen: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(CoordinatorConfig, None, {"metrics.prometheus_listen": f'"{listen}"'})
    assert "metrics.prometheus_listen" in str(info.value) and repr(listen) in str(info.value)


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_a_bulk_port_out_of_range_is_named(port: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(CoordinatorConfig, None, {"bulk_port": port})
    assert f"bulk_port must be in [0, 65535] (got {port})" in str(info.value)


def test_the_old_prometheus_port_key_points_to_its_replacement() -> None:
    with pytest.raises(ConfigError) as info:
        load(CoordinatorConfig, None, {"metrics.prometheus_port": "9100"})
    assert "did you mean 'metrics.prometheus_listen'" in str(info.value)


def test_bad_override_without_a_file_says_it_came_from_the_command_line() -> None:
    with pytest.raises(ConfigError) as info:
        load(CoordinatorConfig, None, {"policy.min_quorum": "0"})
    assert "policy.min_quorum" in str(info.value)
    assert "from the command line" in str(info.value)


def test_bad_override_is_not_blamed_on_the_file_line(tmp_path: Path) -> None:
    # The file's value (3) is fine; the bad 0 came from --set, so the error must not point
    # the operator at the file's line, which holds a valid value.
    message = error_of(tmp_path, FULL, {"policy.min_quorum": "0"})
    assert "policy.min_quorum" in message
    assert "from the command line" in message, message
    assert "line " not in message, message


def test_override_through_a_non_table_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="listen"):
        load(CoordinatorConfig, write(tmp_path, FULL), {"listen.port": "1"})


# -- errors from the file --------------------------------------------------------------------


def test_unknown_key_names_key_line_and_suggestion(tmp_path: Path) -> None:
    text = """\
    listen = "127.0.0.1:5000"

    [policy]
    gamma = 0.5
    min_quorom = 2
    """
    message = error_of(tmp_path, text)
    assert "unknown key 'policy.min_quorom'" in message
    assert f"line {line_of(text, 'min_quorom')}" in message
    assert "did you mean 'policy.min_quorum'" in message


def test_unknown_top_level_key(tmp_path: Path) -> None:
    message = error_of(tmp_path, 'lisen = "127.0.0.1:5000"\n')
    assert "'lisen'" in message and "line 1" in message
    assert "did you mean 'listen'" in message


def test_unknown_key_without_a_close_match_has_no_suggestion(tmp_path: Path) -> None:
    message = error_of(tmp_path, "[outer]\nzzzzzz = 1\n")
    assert "'outer.zzzzzz'" in message and "line 2" in message
    assert "did you mean" not in message


def test_unknown_table(tmp_path: Path) -> None:
    message = error_of(tmp_path, "[polcy]\nmin_quorum = 2\n")
    assert "'polcy'" in message and "did you mean 'policy'" in message


@pytest.mark.parametrize(("text", "key", "needle"), [
    ('[policy]\nmin_quorum = "3"\n', "policy.min_quorum", "min_quorum"),
    ("[policy]\nmin_quorum = true\n", "policy.min_quorum", "min_quorum"),
    ("heartbeat_interval_ms = false\n", "heartbeat_interval_ms", "heartbeat"),
    ("[outer]\nlr = true\n", "outer.lr", "lr ="),
    ('[outer]\nlr = "fast"\n', "outer.lr", "lr ="),
    ("fsync = 1\n", "fsync", "fsync"),
    ("listen = 5000\n", "listen", "listen"),
    ("[policy]\nmin_quorum = 2.0\n", "policy.min_quorum", "min_quorum"),
    ('[auth.tokens]\nalice = 5\n', "auth.tokens.alice", "alice"),
])
def test_wrong_type_names_key_and_line(tmp_path: Path, text: str, key: str, needle: str) -> None:
    message = error_of(tmp_path, text)
    assert f"{key} must be" in message
    assert f"line {line_of(text, needle)}" in message


def test_a_table_given_a_scalar(tmp_path: Path) -> None:
    message = error_of(tmp_path, "policy = 3\n")
    assert "policy must be a table" in message


@pytest.mark.parametrize(("text", "key", "needle"), [
    ("[policy]\ngamma = 0.5\nmin_quorum = 0\n", "policy.min_quorum", "min_quorum"),
    ("[policy]\nmin_quorum = 2\ngamma = 2\n", "policy.gamma", "gamma"),
    ("[policy]\nmax_staleness = -1\n", "policy.max_staleness", "max_staleness"),
    ("[outer]\nlr = 0.7\nmomentum = 1.5\n", "outer.momentum", "momentum"),
    ("[outer]\nlr = 0\n", "outer.lr", "lr ="),
    ("[outer]\nlr = inf\n", "outer.lr", "lr ="),
    ("[limits]\nnorm_bound = nan\n", "limits.norm_bound", "norm_bound"),
    ("[limits]\nmax_params = -1\n", "limits.max_params", "max_params"),
    ("[limits]\nnorm_bound = 1.0\nchunk_bytes = 10\n", "limits.chunk_bytes", "chunk_bytes"),
    ("[limits]\nchunk_bytes = 8388608\n", "limits.chunk_bytes", "chunk_bytes"),
    ("[limits]\nstaging_bytes = -1\n", "limits.staging_bytes", "staging_bytes"),
    ("[limits]\npush_idle_s = 0\n", "limits.push_idle_s", "push_idle_s"),
    ("[limits]\npush_idle_s = inf\n", "limits.push_idle_s", "push_idle_s"),
    ('fsync = true\nlisten = "nope"\n', "listen", "listen"),
    ("fsync = true\nheartbeat_interval_ms = 0\n", "heartbeat_interval_ms", "heartbeat"),
])
def test_invalid_value_names_key_and_line(tmp_path: Path, text: str, key: str,
                                          needle: str) -> None:
    message = error_of(tmp_path, text)
    assert key in message
    assert f"line {line_of(text, needle)}" in message


def test_invalid_value_under_a_commented_table_header_names_the_line(tmp_path: Path) -> None:
    # A comment after a table header is ordinary TOML; the line must still be found.
    text = """\
    [policy]  # how rounds close
    min_quorum = 0
    """
    message = error_of(tmp_path, text)
    assert "policy.min_quorum" in message
    assert "line 2" in message, message


def test_literal_violation_lists_the_choices(tmp_path: Path) -> None:
    text = '[policy]\nmin_quorum = 2\nmerge = "median"\n'
    message = error_of(tmp_path, text)
    assert "policy.merge must be one of ['mean', 'rda']" in message
    assert "'median'" in message
    assert "line 3" in message


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    text = 'listen = "127.0.0.1:5000"\n[policy]\nmin_quorum = = 2\n'
    message = error_of(tmp_path, text)
    assert "ftsync.toml" in message
    assert "line 3" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load(CoordinatorConfig, path)
    assert str(path) in str(info.value)
    assert "cannot read" in str(info.value)


def test_config_error_is_a_value_error() -> None:
    # Callers that catch ValueError around construction keep working.
    assert issubclass(ConfigError, ValueError)


# -- tokens ------------------------------------------------------------------------------------


def test_tokens_file_merges_into_tokens(tmp_path: Path) -> None:
    tokens = write(tmp_path, '[tokens]\nbob = "file-bob"\ncarol = "file-carol"\n', "tok.toml")
    text = FULL.replace("[auth.tokens]", f'[auth]\ntokens_file = "{tokens}"\n\n[auth.tokens]')
    config = load(CoordinatorConfig, write(tmp_path, text))
    assert config.auth.tokens_file == str(tokens)
    assert config.tokens() == {"alice": "secret-alice", "bob": "file-bob",
                               "carol": "file-carol"}


def test_tokens_file_from_an_override(tmp_path: Path) -> None:
    tokens = write(tmp_path, '[tokens]\ndave = "d"\n', "tok.toml")
    config = load(CoordinatorConfig, None, {"auth.tokens_file": str(tokens)})
    assert config.tokens() == {"dave": "d"}


@pytest.mark.parametrize("body", [
    '[tokens]\nalice = "unterminated\n',   # TOML syntax error
    'alice = "a"\n',                       # no [tokens] table
    "tokens = 3\n",                        # tokens not a table
    "[tokens]\nalice = 5\n",               # a token that is not a string
])
def test_malformed_tokens_file_raises_config_error(tmp_path: Path, body: str) -> None:
    tokens = write(tmp_path, body, "tok.toml")
    config = load(CoordinatorConfig, None, {"auth.tokens_file": str(tokens)})
    with pytest.raises(ConfigError, match=r"auth\.tokens_file"):
        config.tokens()


def test_missing_tokens_file_raises_config_error(tmp_path: Path) -> None:
    config = load(CoordinatorConfig, None, {"auth.tokens_file": str(tmp_path / "absent.toml")})
    with pytest.raises(ConfigError, match=r"auth\.tokens_file"):
        config.tokens()


def test_an_empty_token_is_refused_wherever_it_is_configured(tmp_path: Path) -> None:
    inline = load(CoordinatorConfig, None, {"auth.tokens.alice": ""})
    tokens = write(tmp_path, '[tokens]\ndave = ""\ncarol = "c"\n', "tok.toml")
    from_file = load(CoordinatorConfig, None, {"auth.tokens_file": str(tokens)})
    for config, learner in ((inline, "'alice'"), (from_file, "'dave'")):
        with pytest.raises(ConfigError, match=r"auth\.tokens") as refused:
            config.tokens()
        assert learner in str(refused.value) and "empty" in str(refused.value)


# -- describe ----------------------------------------------------------------------------------


def test_describe_lists_every_key_without_token_values(tmp_path: Path) -> None:
    tokens = write(tmp_path, '[tokens]\nerin = "file-secret"\n', "tok.toml")
    config = load(CoordinatorConfig, write(tmp_path, FULL),
                  {"auth.tokens_file": str(tokens)})
    banner = describe(config)
    for secret in ("secret-alice", "secret-bob", "file-secret"):
        assert secret not in banner
    lines = banner.splitlines()
    assert "listen = '0.0.0.0:6000'" in lines
    assert "policy.min_quorum = 3" in lines
    assert "policy.merge = 'rda'" in lines
    assert "outer.nesterov = False" in lines
    assert "limits.chunk_bytes = 1048576" in lines
    assert "auth.tokens = <2 learners>" in lines
    keys = {line.split(" = ")[0] for line in lines}
    for prefix, part in [("", config), ("policy.", config.policy), ("outer.", config.outer),
                         ("limits.", config.limits)]:
        for f in dataclasses.fields(part):
            if not dataclasses.is_dataclass(getattr(part, f.name)):
                assert f"{prefix}{f.name}" in keys


# -- high availability -----------------------------------------------------------------------


def test_ha_section_loads_and_is_off_by_default(tmp_path: Path) -> None:
    assert not CoordinatorConfig().ha.enabled
    config = load(CoordinatorConfig, write(tmp_path, """\
        [ha]
        etcd = ["10.0.0.1:2379", "10.0.0.2:2379"]
        run = "exp-7"
        replica_id = "a"
        advertise = "10.0.1.5:50051"
        replication = "async"
        """))
    assert config.ha.enabled
    assert config.ha.etcd == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert (config.ha.run, config.ha.replica_id, config.ha.advertise) == (
        "exp-7", "a", "10.0.1.5:50051")
    assert config.ha.lease_ttl_s == 3 and config.ha.replication == "async"


def test_ha_mistakes_name_the_key(tmp_path: Path) -> None:
    text = '[ha]\netcd = ["no-port"]\n'
    assert "ha.etcd" in error_of(tmp_path, text) and "line 2" in error_of(tmp_path, text)
    assert "ha.replication" in error_of(tmp_path, '[ha]\nreplication = "quorum"\n')
    assert "ha.lease_ttl_s" in error_of(tmp_path, "[ha]\nlease_ttl_s = 1\n")


def test_etcd_flag_sets_the_endpoints() -> None:
    from coordinator.cli import _config, _parser

    args = _parser().parse_args(["--etcd", "127.0.0.1:1,127.0.0.1:2", "--replica-id", "r1"])
    config = _config(args)
    assert config.ha.etcd == ("127.0.0.1:1", "127.0.0.1:2") and config.ha.replica_id == "r1"


def test_sync_mode_flag_makes_lock_step_rounds_whatever_set_says() -> None:
    from coordinator.cli import _config, _parser

    args = _parser().parse_args(["--sync-mode", "4", "--set", "policy.max_staleness=32",
                                 "--set", "policy.grace_max_s=0.5"])
    policy = _config(args).policy
    assert (policy.min_quorum, policy.grace_max_s, policy.max_staleness) == (4, 0.0, 0)
