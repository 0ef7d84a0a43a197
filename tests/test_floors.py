"""The floors of the code, read from its imports (every import, top-level and inside functions;
imports under ``if TYPE_CHECKING:`` aside, they run only for the type checker).

Floors, bottom up: the kernel (``toren._core``, the ``toren.kernel`` facade), the agent layer
(``toren._agent``, ``toren.providers``), the kinds (their vocabulary in ``toren.runs``,
``toren.channels``, ``toren.sandboxes``; their behaviour in ``actors/``; the worker's tree in
``supervisors/``), and the surfaces (CLI and dev, HTTP, MCP, ``toren.testing``, the composed
settings). Each imports only from its own floor and those below. ``toren`` itself is the public
facade: it re-exports from every floor, and actors import it by design.

Only the kernel holds SQL on the kernel's tables: the others read and write them through its
queries (read from every string of every module).

What is not yet as it should be is named here, in lists that may only shrink: a change that adds
to one is visible in review. docs/architecture.md draws the floors.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import toren.kernel

ROOT = Path(__file__).resolve().parent.parent

KERNEL, AGENT, KINDS, SURFACES = range(4)
FLOOR_NAMES = ("kernel", "agent layer", "kinds", "surfaces")

# Upward imports still made (module -> module above it), none since the kinds' parts of an agent
# came through their seam (toren._agent.parts). A new one needs a reason written here.
UPWARD_NOT_YET_REMOVED: set[tuple[str, str]] = set()

# Import cycles still there, each as the set of modules it spans.
CYCLES_NOT_YET_BROKEN: list[set[str]] = []

# Module-level names that code changes after import (a `global` statement, an item or attribute
# assigned, a mutating method called on them) or that hold a container or an instance of a class
# of their module: process state two workers in one process would share. At most five, each with
# its reason: what is the process's by nature (its classes, its garbage collector, its
# environment), or the single-app default.
MUTABLE_GLOBALS = {
    # the names class statements register: a class is the process's, and so is its name
    "toren/_core/names.py:NAMES": "actor kinds and payload types by name, filled by class "
    "statements (an Actor subclass's kind, @message/@event)",
    # what the process's environment and runtime decide
    "toren/_core/killpoints.py:_armed": "the chaos matrix's kill point, armed from the env, and "
    "the times each point was reached",
    "toren/_core/collector.py:_PAUSES": "the pauses of the (process-wide) garbage collector open "
    "around bursts",
    "toren/testing/_harness.py:_embedded": "one embedded Postgres per test process",
    # the process's agents: what load_app and register_agents fill and a worker runs unless it
    # is given its own Agents (two workers in one process each may have theirs)
    "toren/_agent/registry.py:PROCESS_AGENTS": "the process's agents, for the single-app case",
}
MOST_MUTABLE_GLOBALS = 5

# Containers (their methods change them): one made at module level is state two workers in one
# process would share (per-worker and per-app objects), or the process's one registry (Names).
_CONTAINERS = {"Agents", "Channels", "Directory", "Names", "Providers", "Resources", "Sandboxes"}

_MUTATORS = {
    "add",
    "append",
    "appendleft",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "setdefault",
    "update",
}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``actors/`` as ``toren.actors``)."""
    found: dict[str, Path] = {}
    for base, prefix in (
        (ROOT / "toren", "toren"),
        (ROOT / "actors", "toren.actors"),
        (ROOT / "supervisors", "toren.supervisors"),
    ):
        for path in base.rglob("*.py"):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            if prefix == "toren" and parts and parts[0] in ("actors", "supervisors"):
                continue  # the links: read once, from the folders they point to
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _floor(module: str) -> int | None:
    """The floor ``module`` is on (``None`` for the ``toren`` facade)."""
    if module == "toren":
        return None
    if module.startswith("toren._core") or module in ("toren.kernel", "toren._version"):
        return KERNEL
    if module.startswith(("toren._agent", "toren.providers")):
        return AGENT
    kinds = (
        "toren.runs",
        "toren.channels",
        "toren.sandboxes",
        "toren.schedules",
        "toren.retention",
        "toren.actors",
        "toren.supervisors",
    )
    if module.startswith(kinds) or module == "toren.directory":
        return KINDS
    return SURFACES


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    return skipped


def _resolve(name: str) -> str | None:
    """The module of ours that ``name`` (a module, or a name in one) is in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_lazy_exports(node: ast.AST) -> bool:
    """``_HOMES = {module: names}`` at a package's top: an import of each module, made late."""
    if isinstance(node, ast.AnnAssign):
        target = node.target
    elif isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
    else:
        return False
    return isinstance(target, ast.Name) and target.id == "_HOMES"


def _edges(module: str) -> Iterator[tuple[str, int]]:
    """The modules of ours that ``module`` imports, with the line of each import."""
    tree = ast.parse(MODULES[module].read_text())
    skipped = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if _is_lazy_exports(node):  # a package's names imported on first use (PEP 562)
            assert isinstance(node, ast.AnnAssign | ast.Assign)
            assert isinstance(node.value, ast.Dict)
            for key in node.value.keys:
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    yield key.value, node.lineno
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name) if name.startswith("toren") else None
            if target and target != module and not module.startswith(target + "."):
                yield target, node.lineno


GRAPH = {m: {t for t, _ in _edges(m)} for m in MODULES}


def _cycles() -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    return found


def test_the_modules_are_read() -> None:
    assert {"toren._core.mailbox", "toren.actors.channels.actor", "toren.cli"} <= set(MODULES)
    # an import inside a function counts: the CLI's entry point imports the worker in one
    assert "toren.supervisors.worker" in GRAPH["toren.cli"]


def test_the_kernel_imports_nothing_above_it() -> None:
    for module in MODULES:
        if _floor(module) != KERNEL:
            continue
        for target, line in _edges(module):
            assert _floor(target) == KERNEL, f"{module}:{line} imports {target}"


def test_no_floor_imports_from_a_floor_above_but_those_not_yet_removed() -> None:
    upward = set()
    for module in MODULES:
        below = _floor(module)
        for target, line in _edges(module):
            above = _floor(target)
            if below is not None and above is not None and above > below:
                upward.add((module, target))
                assert (module, target) in UPWARD_NOT_YET_REMOVED, (
                    f"{module}:{line} ({FLOOR_NAMES[below]}) imports {target} "
                    f"({FLOOR_NAMES[above]})"
                )
    assert upward == UPWARD_NOT_YET_REMOVED, "one was removed: take it off the list"


def test_no_import_cycles_but_those_not_yet_broken() -> None:
    cycles = _cycles()
    for cycle in cycles:
        assert cycle in CYCLES_NOT_YET_BROKEN, f"an import cycle: {sorted(cycle)}"
    for known in CYCLES_NOT_YET_BROKEN:
        assert known in cycles, f"broken (or changed): take it off the list: {sorted(known)}"


def _root(node: ast.expr) -> str | None:
    """The name an attribute or item chain starts from (``a`` in ``a.b[c].d``), if a name."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _mutated_globals(path: Path) -> set[str]:
    """The module-level names of ``path`` that hold state: a name rebound by a ``global``
    statement; a name whose items or attributes (at any depth) are assigned or deleted, or
    which a mutating method is called on (``X.add``, ``X.kinds.update``); a name bound at the
    top to a new per-worker container or to an instance of a class the module defines."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        top.update(t.id for t in targets if isinstance(t, ast.Name))
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    found: set[str] = set()
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in _CONTAINERS | classes
        ):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]  # type: ignore[union-attr]
            found.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _MUTATORS
            and _root(node.func.value) in top
        ):
            found.add(_root(node.func.value))  # type: ignore[arg-type]
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            found.update(
                name
                for t in targets
                if isinstance(t, ast.Subscript | ast.Attribute)
                and (name := _root(t)) is not None
                and name in top
            )
    return found


def test_module_level_state_is_only_what_is_listed() -> None:
    found = set()
    for path in MODULES.values():
        rel = path.relative_to(ROOT).as_posix()
        found.update(f"{rel}:{name}" for name in _mutated_globals(path))
    assert found - set(MUTABLE_GLOBALS) == set(), "new module-level state: make it an object's"
    assert set(MUTABLE_GLOBALS) - found == set(), "gone: take it off the list"
    assert len(MUTABLE_GLOBALS) <= MOST_MUTABLE_GLOBALS, "gather the process's state in objects"


def test_no_module_is_over_600_lines_but_those_not_yet_split() -> None:
    not_yet_split: set[str] = set()  # a module to be split along its seams, named here
    over = {
        module
        for module, path in MODULES.items()
        if not module.startswith("toren.testing") and len(path.read_text().splitlines()) > 600
    }
    assert over - not_yet_split == set(), "split it"
    assert not_yet_split - over == set(), "split: take it off the list"


def test_the_kernel_facade_carries_kernel_names_only() -> None:
    for name in toren.kernel.__all__:
        value = getattr(toren.kernel, name)
        where = getattr(value, "__module__", None) or ""
        if where.startswith("toren"):
            assert _floor(where) == KERNEL, f"toren.kernel.{name} is from {where}"
    assert sorted(toren.kernel.__all__) == [
        "ActorHost", "ActorRow", "Archives", "BatchOutcomeUnknown", "Claim", "Clock",
        "EmbeddedPostgres", "GroupCommit", "Kind", "LeaseClock",
        "MessageDeadLettered", "MissingResource", "RateLimit", "Refusal", "Resources", "Route",
        "Runtime",
        "Service", "ShiftedClock", "Surfaces", "TRANSIENT_DB_ERRORS", "WorkerEnv",
        "WorkerSession", "actor_kinds", "actor_row", "actor_rows", "actors_of_kind",
        "archive_old_deadletters", "block_rate",
        "claim", "code_version", "connect", "create_pool", "decode", "events", "events_after",
        "housekeep", "json_text", "kill_point", "last_seq", "live_workers", "mark_failed",
        "migrate", "open_death_watch", "printable", "rate_windows", "release", "release_claim",
        "renew", "ring_position", "safe_text", "schema_status", "set_args", "singleton",
        "successor", "take_rate", "utf8_size", "wait_for_death", "waiting", "window_of",
    ]  # fmt: skip


# --- the kernel's tables, through the kernel's queries ------------------------------------------

# Tables the kernel's migrations create for the floors above, each read and written by its own
# module there: not the kernel's.
NOT_KERNEL_TABLES = {
    "tokens": "the HTTP API's tokens (toren/_surfaces/tokens.py)",
    "auth_failures": "failed authentications per address (toren/_surfaces/http/guard.py)",
    "sessions": "the console's sessions (toren/_surfaces/tokens.py)",
    "pairing_key": "the channels' pairing key (toren/channels/pairing.py)",
    "run_audit": "pruned runs' audit records (toren/runs/audit.py, toren/runs/costs.py)",
    "prune_log": "what each prune removed (toren/runs/audit.py)",
}
_SQL = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|FROM|JOIN)\b", re.IGNORECASE)


def _kernel_tables() -> set[str]:
    """The tables and views the kernel's migrations create, but those of ``NOT_KERNEL_TABLES``."""
    created = re.compile(r"CREATE\s+(?:TABLE|VIEW)\s+toren\.(\w+)", re.IGNORECASE)
    found = {
        name
        for path in (ROOT / "toren" / "_core" / "migrations").glob("*.sql")
        for name in created.findall(path.read_text())
    }
    return found - set(NOT_KERNEL_TABLES)


def _strings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Every string a module writes: constants, f-strings (their literal parts, each value as
    ``{}``) and sums of those, whole (a statement split over ``+`` is read as one)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if id(node) in inside:
            continue
        text = _text(node)
        if text is not None:
            inside.update(id(n) for n in ast.walk(node))
            yield node.lineno, text  # type: ignore[attr-defined]


def _text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) or "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is not None or right is not None:
            return (left or "{}") + (right or "{}")
    return None


def test_only_the_kernel_holds_sql_on_its_tables() -> None:
    """The kernel's tables are read and written through the kernel's own queries
    (``toren/_core/rows.py``, ``journal_reads.py``, ...): no module above it holds a statement
    that names one. ``toren/testing`` may (test-only SQL: the harness resets and inspects the
    database)."""
    tables = _kernel_tables()
    assert {"actors", "journal", "mailbox", "workers", "run_status_counts"} <= tables
    named = re.compile(rf"\btoren\.({'|'.join(sorted(tables))})\b(?!\.)")  # not a module
    found = []
    for module, path in MODULES.items():
        if _floor(module) == KERNEL or module.startswith("toren.testing"):
            continue
        for line, text in _strings(ast.parse(path.read_text())):
            table = named.search(text)
            if table and _SQL.search(text):
                found.append(f"{path.relative_to(ROOT)}:{line} ({table.group()})")
    assert found == [], "SQL on the kernel's tables outside it; add a kernel query:\n" + "\n".join(
        found
    )
