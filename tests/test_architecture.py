"""Architecture checks of issue 16 ("Must show"): the tree tells the architecture.

Fails when
* a non-test Rust source file under crates/*/src has more than 1,000 lines;
* the edge (crates/edge/src) branches on the substrate kind outside its registry;
* the workspace crates' dependency graph has a cycle;
* the edge's top-level modules import each other in a cycle;
* a crate has no crate-level doc comment saying what it owns and what it must not do.

Offenders that another piece of work is fixing are listed in KNOWN_* below with a reason;
they are printed as remaining work. Any offender not on a list fails, and so does a listed
exception that no longer offends (the lists can only shrink). Needs no root.
"""

import json
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = os.path.join(ROOT, "crates")
EDGE_SRC = os.path.join(CRATES, "edge", "src")
MAX_LINES = 1000

# file (relative to the repo) -> reason. Issue 16.
KNOWN_LONG_FILES = {}
# file -> reason. Issue 16. (The registry crates/edge/src/substrates.rs is allowed by design.)
KNOWN_SUBSTRATE_BRANCHES = {}
# frozenset of edge modules forming one import cycle (a strongly connected component) -> reason.
KNOWN_EDGE_CYCLES = {
    frozenset(["commands", "config", "files", "manager", "network", "trajectory", "tty", "vm_config"]):
    "issue 16: the lifecycle modules reach back into manager (Manager, lock helpers); breaking "
    "it needs the manager/ split by verb, not this session",
}

# The edge's substrate registry: the one place allowed to name substrate kinds in branches.
SUBSTRATE_REGISTRY = {"crates/edge/src/substrates.rs"}


def rel(path):
    return os.path.relpath(path, ROOT)


def crate_dirs():
    return sorted(
        os.path.join(CRATES, d)
        for d in os.listdir(CRATES)
        if os.path.isfile(os.path.join(CRATES, d, "Cargo.toml"))
    )


def rust_files(src):
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(d for d in dirnames if d != "tests")
        for f in sorted(filenames):
            if f.endswith(".rs"):
                yield os.path.join(dirpath, f)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def strip_comments(text):
    """Drops // and /* */ comments (not perfect for comment markers inside strings, which is
    fine for looking for code references)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def cfg_test_files():
    """Files declared as `#[cfg(test)] mod x;` (and `tests.rs`), which are test code."""
    out = set()
    for crate in crate_dirs():
        for path in rust_files(os.path.join(crate, "src")):
            text = read(path)
            here = os.path.dirname(path)
            stem = os.path.splitext(os.path.basename(path))[0]
            # Children of lib.rs/main.rs/mod.rs live beside it, children of x.rs in x/.
            child_dir = here if stem in ("lib", "main", "mod") else os.path.join(here, stem)
            for m in re.finditer(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text):
                name = m.group(1)
                for cand in (os.path.join(child_dir, name + ".rs"), os.path.join(child_dir, name, "mod.rs")):
                    out.add(os.path.normpath(cand))
            if os.path.basename(path) == "tests.rs":
                out.add(os.path.normpath(path))
    return out


def check_exceptions(kind, offenders, known):
    """offenders: key -> description. Prints the known ones, returns failure messages."""
    failures = []
    for key, what in sorted(offenders.items(), key=lambda kv: str(kv[0])):
        if key in known:
            print(f"REMAINING WORK ({kind}): {what} -- known exception: {known[key]}")
        else:
            failures.append(f"{kind}: {what}")
    for key, reason in known.items():
        if key not in offenders:
            failures.append(
                f"{kind}: listed exception {sorted(key) if isinstance(key, frozenset) else key} "
                f"no longer offends ({reason}); remove it from the list in tests/test_architecture.py"
            )
    return failures


def test_no_source_file_over_1000_lines():
    tests = cfg_test_files()
    offenders = {}
    for crate in crate_dirs():
        for path in rust_files(os.path.join(crate, "src")):
            if os.path.normpath(path) in tests:
                continue
            n = read(path).count("\n")
            if n > MAX_LINES:
                offenders[rel(path)] = f"{rel(path)} has {n} lines (limit {MAX_LINES})"
    failures = check_exceptions("file too long", offenders, KNOWN_LONG_FILES)
    assert not failures, "\n".join(failures)


KIND = r"(?:\w+::)*Substrate::(?:Container|Microvm|Vm)\b"


def substrate_branches(text):
    """(line number, line) of every branch on the substrate kind: `==`/`!=` comparisons,
    `matches!`, `match` arms and `if let`/`let ... else` patterns. Constructing a value
    (`substrate: Substrate::Container`, a default, a return value) is data, not a branch."""
    code = strip_comments(text)
    hits = set()
    patterns = [
        rf"(?:==|!=)\s*&?\s*{KIND}",
        rf"{KIND}\s*(?:==|!=)",
        # a match arm: one or more kinds joined by `|`, then `=>` or a guard
        rf"(?m)^\s*\|?\s*{KIND}(?:\s*\|\s*{KIND})*\s*(?:\|\s*$|=>|if\b|$(?=\s*(?:\|\s*)?(?:{KIND}\s*)?=>))",
        rf"\blet\s+{KIND}\s*=",
    ]
    for pat in patterns:
        for m in re.finditer(pat, code):
            hits.add(code.count("\n", 0, m.start()) + 1)
    for m in re.finditer(r"matches!\s*\(", code):
        depth, i = 1, m.end()
        while i < len(code) and depth:
            depth += {"(": 1, ")": -1}.get(code[i], 0)
            i += 1
        if re.search(KIND, code[m.end():i]):
            hits.add(code.count("\n", 0, m.start()) + 1)
    lines = code.split("\n")
    return sorted((n, lines[n - 1].strip()) for n in hits)


def test_substrate_branch_detector_finds_branches_and_ignores_data():
    branchy = """
        if req.substrate == Substrate::Vm { }
        let x = matches!(s, Substrate::Microvm | Substrate::Vm);
        match s {
            Substrate::Container => 1,
            Substrate::Microvm
            | Substrate::Vm => 2,
        }
    """
    assert len(substrate_branches(branchy)) >= 4
    data = """
        let rec = Record { substrate: Substrate::Container, ..Default::default() };
        fn kind(&self) -> Substrate { dsec_wire::api::Substrate::Microvm }
        // if s == Substrate::Vm (a comment)
    """
    assert substrate_branches(data) == []


def test_edge_does_not_branch_on_substrate_outside_registry():
    offenders = {}
    for path in rust_files(EDGE_SRC):
        if rel(path) in SUBSTRATE_REGISTRY:
            continue
        hits = substrate_branches(read(path))
        if hits:
            where = "; ".join(f"{rel(path)}:{n}: {line}" for n, line in hits)
            offenders[rel(path)] = f"{len(hits)} branch(es) on the substrate kind: {where}"
    failures = check_exceptions("substrate branch", offenders, KNOWN_SUBSTRATE_BRANCHES)
    assert not failures, "\n".join(failures)


def find_cycle(graph, component):
    """One cycle through the component, as a list of nodes (first == last)."""
    start = sorted(component)[0]
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in component:
                continue
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return [start, start]


def strongly_connected(graph):
    """Tarjan's algorithm; returns the components with more than one node (or a self-loop)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    comps = strongly_connected(g)
    assert comps == [frozenset("abc")]
    assert find_cycle(g, comps[0]) == ["a", "b", "c", "a"]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


def test_crate_dependency_graph_is_acyclic():
    cargo = shutil.which("cargo") or os.path.expanduser("~/.cargo/bin/cargo")
    if not os.path.exists(cargo):
        pytest.skip("cargo not found on PATH: cannot read the crate graph")
    meta = json.loads(
        subprocess.run(
            [cargo, "metadata", "--no-deps", "--format-version", "1", "--offline"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout
    )
    members = {p["name"] for p in meta["packages"]}
    # All kinds, dev-dependencies included: a test of a lower crate depending on a higher one
    # is a layering cycle too.
    graph = {
        p["name"]: {d["name"] for d in p["dependencies"] if d["name"] in members and d["name"] != p["name"]}
        for p in meta["packages"]
    }
    print("crate graph:", {k: sorted(v) for k, v in sorted(graph.items())})
    cycles = [" -> ".join(find_cycle(graph, c)) for c in strongly_connected(graph)]
    assert not cycles, "the crates' dependency graph has cycles: " + "; ".join(cycles)


def edge_module_graph():
    """Top-level module of crates/edge/src -> {module: first reference "file:line"}."""
    modules = {}
    for entry in sorted(os.listdir(EDGE_SRC)):
        full = os.path.join(EDGE_SRC, entry)
        if entry.endswith(".rs") and entry not in ("lib.rs", "main.rs"):
            modules[entry[:-3]] = [full]
        elif os.path.isdir(full):
            modules[entry] = list(rust_files(full))
    graph = {}
    for mod, files in modules.items():
        refs = {}
        for path in files:
            code = strip_comments(read(path))
            found = []
            for m in re.finditer(r"\bcrate::(\w+)", code):
                found.append((m.group(1), m.start()))
            # grouped imports: use crate::{a, b::c, d::{e, f}}
            for m in re.finditer(r"\bcrate::\{", code):
                depth, i = 1, m.end()
                while i < len(code) and depth:
                    depth += {"{": 1, "}": -1}.get(code[i], 0)
                    i += 1
                inner = code[m.end():i - 1]
                # names at nesting depth 0 of the group
                level, token_start = 0, 0
                for j, ch in enumerate(inner + ","):
                    if ch == "{":
                        level += 1
                    elif ch == "}":
                        level -= 1
                    elif ch == "," and level == 0:
                        name = re.match(r"\s*(\w+)", inner[token_start:j])
                        if name:
                            found.append((name.group(1), m.start()))
                        token_start = j + 1
            for name, pos in found:
                if name in modules and name != mod and name not in refs:
                    refs[name] = f"{rel(path)}:{code.count(chr(10), 0, pos) + 1}"
        graph[mod] = refs
    return graph


def test_edge_modules_do_not_import_each_other_in_a_cycle():
    graph = edge_module_graph()
    offenders = {}
    for comp in strongly_connected({m: set(r) for m, r in graph.items()}):
        cycle = find_cycle({m: set(r) for m, r in graph.items()}, comp)
        evidence = ", ".join(f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:]))
        offenders[comp] = (
            f"edge modules {sorted(comp)} import each other in a cycle, e.g. {evidence}"
        )
    failures = check_exceptions("edge module cycle", offenders, KNOWN_EDGE_CYCLES)
    assert not failures, "\n".join(failures)


def crate_doc(crate):
    for root in ("src/lib.rs", "src/main.rs"):
        path = os.path.join(crate, root)
        if os.path.exists(path):
            lines = read(path).split("\n")
            doc = []
            for line in lines:
                if line.startswith("//!"):
                    doc.append(line[3:].strip())
                elif line.strip() == "" and not doc:
                    continue
                else:
                    break
            return path, " ".join(doc)
    return None, ""


def test_every_crate_has_a_doc_comment_saying_what_it_owns_and_must_not_do():
    failures = []
    for crate in crate_dirs():
        path, doc = crate_doc(crate)
        name = os.path.basename(crate)
        if path is None:
            failures.append(f"crate {name}: no src/lib.rs or src/main.rs")
        elif not doc:
            failures.append(f"crate {name}: {rel(path)} does not start with a `//!` crate doc comment")
        elif not re.search(r"\bmust not\b|\bmust never\b", doc, re.I):
            failures.append(
                f"crate {name}: the crate doc of {rel(path)} does not say what the crate must not do "
                "(a sentence with 'must not')"
            )
    assert not failures, "\n".join(failures)
