"""Env files: what is refused (with file and line) and what is read, and every template."""

import re

import pytest

from dsv41_stack.cli import TEMPLATES, template_path
from dsv41_stack.config import ConfigError, StackConfig, parse


def test_values_comments_quotes_and_export():
    values = parse('# a comment\nexport STACK_TP=2\nENGRAM_REMOTE="10.0.0.1:7480"  # link 0\n'
                   "STACK_DRAFTER=''\n")
    assert values == {"STACK_TP": "2", "ENGRAM_REMOTE": "10.0.0.1:7480", "STACK_DRAFTER": ""}


@pytest.mark.parametrize("text, why", [
    ("STACK_MODEL=<path to the checkpoint>\n", "placeholder"),
    ("STACK_MODLE=/models/x\n", "unknown setting STACK_MODLE"),
    ("PATH=/usr/bin\n", "neither a STACK_ setting nor a component variable"),
    ("REMOTE_DRAFTER_ADRESS=10.0.0.1:7490\n", "REMOTE_DRAFTER_ADRESS is not a variable its component"),
    ("OFL_AUTHKEY=x\n", "OFL_AUTHKEY is not a variable its component declares"),
    ("this is not an assignment\n", "not KEY=VALUE"),
    ("STACK_MODEL=/a b\n", "has spaces"),
    ("STACK_MODEL='/a\n", "STACK_MODEL: No closing quotation"),
    ("STACK_TP=two\n", "STACK_TP='two': expected a whole number >= 0"),
    ("STACK_KV_BYTES=6GiB\n", "expected a whole number"),
    ("STACK_ENGINE_LISTEN=localhost\n", "STACK_ENGINE_LISTEN='localhost': expected HOST:PORT"),
    ("STACK_ENFORCE_EAGER=yes\n", "expected 0 or 1"),
    ("VLLM_DSPARK_REMOTE_ASYNC=false\n", "VLLM_DSPARK_REMOTE_ASYNC='false': expected 0 or 1"),
    ("ENGRAM_DEADLINE_MS=fast\n", "expected a number >= 0"),
    ("REMOTE_DRAFTER_MAX_REQUESTS_PER_CLIENT=many\n", "expected a whole number >= 0 or 'auto'"),
    ("OFL_BACKEND=rdma\n", "expected 'verbs' or 'tcp' or 'shm'"),
    ("OFL_INSECURE=1\n", "never run open to every peer"),
    ("DRAFTER_TP2_TIMEOUTS=1\n", "DRAFTER_TP2_TIMEOUTS is not a variable its component declares"),
    ("DRAFTER_TP2_TIMEOUT_S=soon\n", "expected a number"),
])
def test_refused_lines_say_where_and_why(text, why):
    with pytest.raises(ConfigError, match=rf"f\.env:1: .*{why}"):
        parse(text, "f.env")


def test_a_hash_inside_a_value_is_the_values_own():
    """As a shell reads it: a comment starts at a `#` after whitespace, outside quotes."""
    values = parse("OFL_AUTH_KEY=abc#def0123456789\nSTACK_MODEL=/data/run#2/model  # the second run\n"
                   "STACK_DRAFTER='/a #b'\nSTACK_DRAFTER_TARGET= # nothing yet, was <the old one>\n")
    assert values == {"OFL_AUTH_KEY": "abc#def0123456789", "STACK_MODEL": "/data/run#2/model",
                      "STACK_DRAFTER": "/a #b", "STACK_DRAFTER_TARGET": ""}


def test_every_declared_default_is_a_value_of_its_own_kind():
    from dsv41_stack.settings import declared
    known = declared()
    assert len(known) > 90 and "DRAFTER_TP2_TIMEOUT_S" in known  # drafter-tp2's, installed here
    assert {n: v.problem(v.default) for n, v in known.items() if v.problem(v.default)} == {}


def test_later_files_override_and_defaults_fill_in(tmp_path):
    (tmp_path / "d.env").write_text("STACK_TP=2\nREMOTE_DRAFTER_ADDRESS=10.0.0.1:7490\n")
    (tmp_path / "async.env").write_text("STACK_TP=1\nVLLM_DSPARK_REMOTE_ASYNC=1\n")
    cfg = StackConfig.load([tmp_path / "d.env", tmp_path / "async.env"])
    assert cfg["STACK_TP"] == "1" and cfg["STACK_MAX_NUM_SEQS"] == "4"  # override, default
    assert cfg.components("VLLM_DSPARK_", "REMOTE_DRAFTER_") == {
        "REMOTE_DRAFTER_ADDRESS": "10.0.0.1:7490", "VLLM_DSPARK_REMOTE_ASYNC": "1"}
    rolled_back = cfg.with_values(VLLM_DSPARK_REMOTE_ASYNC=None)
    assert "VLLM_DSPARK_REMOTE_ASYNC" not in rolled_back.components()


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_template_reads_once_filled(name):
    text = template_path(name).read_text()
    if "<" in text:
        with pytest.raises(ConfigError, match="placeholder"):
            parse(text)  # as shipped: refused until an operator fills it in
    filled = re.sub(r"<[^<>]+>", "x", text)
    assert parse(filled)
    for line in text.splitlines():  # every production setting says what it does above it
        if name != "local" and line and not line.startswith("#"):
            previous = text.splitlines()[text.splitlines().index(line) - 1]
            assert previous.startswith("#"), f"{name}: {line} has no comment"


def test_production_admits_by_allow_list_and_key_file_and_local_by_loopback():
    """Production (D, and D with the async delta over it) names the engine hosts and the
    key's file, never the key itself; the local template listens on loopback only."""
    filled = [re.sub(r"<[^<>]+>", "x", template_path(n).read_text())
              for n in ("production-D", "production-async")]
    production = {**parse(filled[0]), **parse(filled[1])}
    assert production["STACK_ENGINE_HOSTS"] and production["OFL_AUTH_KEY_FILE"]
    assert "OFL_AUTH_KEY" not in production
    local = StackConfig.load([template_path("local")])
    assert not local["OFL_AUTH_KEY"] and not local["OFL_AUTH_KEY_FILE"]
    listens = [local["STACK_ENGRAM_LISTEN"], local["STACK_DRAFTER_LISTEN"]]
    assert all(address.startswith("127.0.0.1:") for address in listens)


def test_the_fleet_delta_gives_every_rank_both_hosts(tmp_path):
    """production-fleet over production-D: ENGRAM_HOSTS replaces ENGRAM_REMOTE (which it
    empties: both set is refused), and the drafter gains a standby."""
    from remote_engram import env as engram_env
    paths = []
    for name in ("production-D", "production-fleet"):
        paths.append(tmp_path / f"{name}.env")
        paths[-1].write_text(re.sub(r"<([^<>]+)>", lambda m: m.group(1).split()[1] if m.group(1).startswith("host ")
                                    else "x", template_path(name).read_text()))
    cfg = StackConfig.load(paths)
    for rank in (0, 1):
        hosts = engram_env.hosts_for_rank(rank, cfg[engram_env.ENGRAM_REMOTE], cfg[engram_env.ENGRAM_HOSTS])
        assert hosts == ["0:7480", "1:7480"], hosts
    assert cfg["REMOTE_DRAFTER_STANDBYS"] == "1:7490" and cfg["REMOTE_DRAFTER_ADDRESS"] == "x:7490"
