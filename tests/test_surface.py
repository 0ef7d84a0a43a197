"""The public surface: exported names, layering between packages, payload codec, settings."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import toren
import toren.kernel
from toren import ConfigError, Settings, UnknownMessageType, message
from toren._core.codec import decode, encode

ROOT = Path(__file__).resolve().parent.parent


def test_public_api_is_pinned() -> None:
    assert sorted(toren.__all__) == [
        "Actor", "ActorAlreadyExists", "ActorFailed", "ActorNotLive", "Agent", "AskError",
        "AskFailed", "AskTimeout", "ChildFailed", "Client", "ConfigError", "Context",
        "DatabaseUnavailable", "DeadLetter", "EffectOutsideHandler", "Envelope", "FencedOut",
        "History", "InternalError", "JournalEntry", "LeaseExpired", "Ledger", "MailboxFull",
        "MemoryRestartStore", "MigrationError", "PoisonMessage", "PostgresRestartStore",
        "Principal", "RateLimit", "RestartStore", "Retention",
        "Settings", "SupervisorEscalation", "Tool", "ToolContext", "TorenError", "UnknownActor",
        "UnknownActorKind", "UnknownMessageType", "__version__", "durable_sleep", "event",
        "message", "recorded_dev_url", "tool",
    ]  # fmt: skip
    # (the order within __all__ is ruff's RUF022: constants, classes, functions)
    for name in toren.__all__ + toren.kernel.__all__:
        assert hasattr(toren, name) or hasattr(toren.kernel, name), name


@pytest.mark.parametrize(
    "package", ["toren", "toren.runs", "toren.sandboxes", "toren.channels", "toren.schedules"]
)
def test_a_packages_names_are_imported_on_first_use_and_listed(package: str) -> None:
    module = importlib.import_module(package)
    homes = vars(module)["_HOMES"]
    for home, names in homes.items():
        for name in names:
            assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert set(module.__all__) <= set(dir(module))
    assert dir(module) == sorted(dir(module))
    with pytest.raises(AttributeError, match=f"^module '{package}' has no attribute 'nothing'$"):
        module.nothing  # noqa: B018 (the access is the test)


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


# actors/ and supervisors/ are installed as toren.actors and toren.supervisors (toren/actors and
# toren/supervisors link to them), so that an app may have packages of those names.
LAYERS = {"actors", "supervisors"}


def _layer(module: str) -> str | None:
    """``actors`` or ``supervisors`` if ``module`` belongs to that layer."""
    parts = module.split(".")
    if parts[0] == "toren" and len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return parts[0] if parts[0] in LAYERS else None


def _kernel_files() -> list[Path]:
    return [
        p
        for p in (ROOT / "toren").rglob("*.py")
        if p.relative_to(ROOT / "toren").parts[0] not in LAYERS
    ]


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_actors_and_supervisors_use_only_the_public_kernel_api(package: str) -> None:
    files = list((ROOT / package).rglob("*.py"))
    assert files
    for path in files:
        for name in _imports(path):
            assert name.split(".")[0] not in LAYERS, f"{path.name}: {name} (import toren.{name})"
            if (name == "toren" or name.startswith("toren.")) and _layer(name) is None:
                parts = name.split(".")
                assert not any(p.startswith("_") for p in parts[1:]), f"{path.name}: {name}"


def test_the_kernel_imports_nothing_from_actors_or_supervisors_but_worker_entry_points() -> None:
    entry_points = {"cli.py", "up.py", "dev.py", "_harness.py"}  # _harness: tests run one
    files = _kernel_files()
    assert any(p.parent.name == "http" for p in files)  # subfolders are scanned too
    for path in files:
        for name in _imports(path):
            if _layer(name) is not None:
                assert path.name in entry_points, f"{path.relative_to(ROOT)} imports {name}"


def test_no_bare_asyncio_tasks_in_library_code() -> None:
    for package in ("toren", "actors", "supervisors"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            for call in ("create_task(", "ensure_future(", "asyncio.gather(", "asyncio.wait_for("):
                assert call not in text, f"{path.relative_to(ROOT)} uses {call}"


def test_the_cli_describes_its_commands_without_the_server_the_agent_layer_or_asyncpg() -> None:
    # `toren --help` imports toren.cli and every module its commands are defined in; each command
    # imports what it uses in its body, so that the CLI starts in well under half a second.
    heavy = ("aiohttp", "pydantic", "asyncpg", "toren._agent.agents", "toren.runs.state")
    probe = f"import sys, toren.cli; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stdout + done.stderr


def test_listing_runs_does_without_the_agent_layer() -> None:
    # `toren jobs list` reads rows: it needs asyncpg, not what defines agents (pydantic), nor
    # the fold (a regression once cost the command 90 ms).
    heavy = ("aiohttp", "pydantic", "toren._agent.agents", "toren.runs.state")
    probe = (
        "import sys, toren.cli, toren.runs.listing; "
        f"print([m for m in {heavy!r} if m in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stdout + done.stderr


def test_no_cli_module_imports_the_cli_entry_point() -> None:
    # toren.cli imports them; what they share with it at boot is in toren._cli.boot.
    for path in (ROOT / "toren" / "_cli").glob("*.py"):
        assert "toren.cli" not in _imports(path), f"{path.name} imports toren.cli"


@message("test.payload")
@attrs.frozen(kw_only=True)
class Payload:
    text: str
    n: int
    items: tuple[str, ...]
    extra: dict[str, int]
    maybe: float | None


json_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"))


@given(
    st.builds(
        Payload,
        text=json_text,
        n=st.integers(-(2**53), 2**53),
        items=st.tuples(json_text, json_text),
        extra=st.dictionaries(json_text, st.integers(-1000, 1000), max_size=4),
        maybe=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    )
)
def test_payloads_round_trip_through_the_codec(payload: Payload) -> None:
    import orjson

    name, body = encode(payload)
    assert name == "test.payload"
    assert decode(name, orjson.loads(orjson.dumps(body))) == payload


def test_plain_dicts_are_payloads_and_unknown_types_are_refused() -> None:
    assert encode({"a": 1}) == ("json", {"a": 1})
    with pytest.raises(UnknownMessageType):
        decode("nobody.registered.this", {})

    @attrs.frozen
    class Unregistered:
        x: int

    with pytest.raises(UnknownMessageType):
        encode(Unregistered(1))


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "1e400", "-inf"])
def test_a_numeric_setting_from_the_environment_is_a_finite_number(value: str) -> None:
    """TOREN_LEASE_SECONDS=nan (or a file holding it) would make every lease end at NaN."""
    with pytest.raises(ConfigError, match="lease_seconds must be a positive finite number"):
        Settings.load(env={"TOREN_LEASE_SECONDS": value})


def test_settings_come_from_toml_then_environment_then_overrides(tmp_path: Path) -> None:
    config = tmp_path / "toren.toml"
    config.write_text('database_url = "postgresql://from-file"\n[worker]\nlease_seconds = 9\n')
    settings = Settings.load(
        config_file=config, env={"TOREN_LEASE_SECONDS": "12"}, renew_seconds=2.0
    )
    assert settings.database_url == "postgresql://from-file"
    assert settings.lease_seconds == 12.0
    assert settings.renew_seconds == 2.0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("lease_second = 3\n", "unknown setting"),
        ("lease_seconds = 'x'\n", "lease_seconds"),
        ("max_actors = 0\n", "max_actors must be a positive finite number"),
        ("lease_seconds = nan\n", "lease_seconds must be a positive finite number"),
        ("grace_seconds = inf\n", "grace_seconds must be a positive finite number"),
        ("not toml at all [", "cannot read config file"),
        ("[wroker]\nlease_seconds = 3\n", "unknown table"),
    ],
)
def test_bad_settings_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    config = tmp_path / "toren.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        Settings.load(config_file=config, env={})
