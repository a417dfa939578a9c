"""Cluster (issue 5): 3 real edges (separate processes, data dirs and loopback ports) and 2
apiserver replicas sharing one IAM database -- SQLite (a shared file) and PostgreSQL (a private
cluster started for the module on a free loopback port) alike; plus simulated edges
(test/benchmark mode) for overflow and the 32,000-create burst."""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional, Tuple

import pytest

from helpers import find_aether, free_port, wait_until


# ---------------------------------------------------------------------------------------------
# plumbing


def call(method: str, url: str, key: str = "", body=None, timeout: float = 60.0) -> Tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else {}), dict(r.headers)
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw), dict(e.headers)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}, dict(e.headers)


class Proc:
    """A dsec server process; reads KEY=VALUE lines from stdout until `want` are all seen."""

    def __init__(self, argv: List[str], want: List[str], env: Optional[Dict[str, str]] = None):
        self.argv = argv
        self.want = want
        self.env = env
        self.vars: Dict[str, List[str]] = {}
        self.p: Optional[subprocess.Popen] = None
        self.log = tempfile.NamedTemporaryFile(prefix="dsec-cluster-", suffix=".log", delete=False)

    def start(self, timeout: float = 60.0) -> "Proc":
        env = dict(os.environ)
        env.update(self.env or {})
        self.p = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        deadline = time.time() + timeout
        assert self.p.stdout is not None
        while not all(w in self.vars for w in self.want):
            if time.time() > deadline or self.p.poll() is not None:
                raise RuntimeError(f"{self.argv[:3]} did not start: see {self.log.name}")
            line = self.p.stdout.readline()
            if "=" in line:
                k, v = line.strip().split("=", 1)
                self.vars.setdefault(k, []).append(v)
        return self

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.p and self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()

    def first(self, k: str) -> str:
        return self.vars[k][0]


def apiserver(dsec: str, db: str, env_file: str, edges: List[str], *extra: str) -> Proc:
    argv = [dsec, "apiserver", "--listen", f"127.0.0.1:{free_port()}", "--db", db,
            "--env-file", env_file, "--watcher-period-ms", "200"]
    for e in edges:
        argv += ["--edge", e]
    argv += list(extra)
    return Proc(argv, ["DSEC_API_URL", "DSEC_API_KEY"]).start()


# ---------------------------------------------------------------------------------------------
# a private PostgreSQL cluster (initdb + pg_ctl as the `postgres` user, in a temp dir)


def pg_bindir() -> Optional[str]:
    """Directory of Debian's postgres server binaries (initdb, pg_ctl, postgres), if installed."""
    for d in [os.environ.get("DSEC_PG_BINDIR", "")] + sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if d and all(os.access(os.path.join(d, b), os.X_OK) for b in ("initdb", "pg_ctl", "postgres", "psql")):
            return d
    return None


class PgCluster:
    """A throwaway PostgreSQL server on 127.0.0.1:<free port>, trust auth for user `dsec`.
    Stopped by the postmaster's PID and removed afterwards."""

    def __init__(self, bindir: str):
        self.bindir = bindir
        self.dir = tempfile.mkdtemp(prefix="dsec-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        self.pid: Optional[int] = None
        pw = pwd.getpwnam("postgres")
        os.chown(self.dir, pw.pw_uid, pw.pw_gid)

    def _as_postgres(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["runuser", "-u", "postgres", "--", *argv], capture_output=True, text=True,
                              timeout=120, cwd=self.dir)

    def start(self) -> "PgCluster":
        r = self._as_postgres(os.path.join(self.bindir, "initdb"), "-D", self.data, "-U", "dsec",
                              "--auth=trust", "-E", "UTF8", "--no-sync")
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {r.stderr[-2000:]}")
        opts = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c max_connections=200")
        r = self._as_postgres(os.path.join(self.bindir, "pg_ctl"), "-D", self.data, "-l",
                              os.path.join(self.dir, "log"), "-o", opts, "-w", "-t", "60", "start")
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {r.stderr[-2000:]} (log: {self.dir}/log)")
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            self.pid = int(f.readline().strip())
        return self

    def create_db(self, name: str) -> str:
        """A fresh database; its URL."""
        r = subprocess.run([os.path.join(self.bindir, "psql"), "-h", "127.0.0.1", "-p", str(self.port),
                            "-U", "dsec", "-d", "postgres", "-v", "ON_ERROR_STOP=1",
                            "-c", f'CREATE DATABASE "{name}"'], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return f"postgres://dsec@127.0.0.1:{self.port}/{name}"

    def query(self, url: str, sql: str) -> str:
        """The single value `sql` returns on the database at `url`."""
        r = subprocess.run([os.path.join(self.bindir, "psql"), url, "-tA", "-v", "ON_ERROR_STOP=1", "-c", sql],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    def stop(self) -> None:
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGINT)  # fast shutdown
            except ProcessLookupError:
                pass
            deadline = time.time() + 30
            while time.time() < deadline:
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.pid = None
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_server():
    bindir = pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries absent (Debian's `postgresql`; scripts/install-deps.sh installs it)")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no `postgres` user to run the PostgreSQL server as")
    pg = PgCluster(bindir)
    try:
        pg.start()
    except (RuntimeError, subprocess.SubprocessError) as e:
        pg.stop()
        pytest.fail(str(e), pytrace=False)
    yield pg
    pg.stop()


BACKENDS = ["sqlite", "postgres"]


def backend_db(request, backend: str, dir_: str, name: str) -> str:
    """`--db` for a backend: a SQLite file in `dir_`, or a fresh database on the module's
    private PostgreSQL server."""
    if backend == "sqlite":
        return os.path.join(dir_, f"{name}.db")
    pg = request.getfixturevalue("pg_server")
    return pg.create_db(f"{name}_{os.getpid()}_{int(time.time() * 1000) % 10**9}")


# ---------------------------------------------------------------------------------------------
# the real cluster: 3 edges + 2 apiservers


class Cluster:
    def __init__(self, dsec: str):
        self.dsec = dsec
        self.dir = tempfile.mkdtemp(prefix="dsec-cluster-")
        self.token = "cluster-test-token-0123456789"
        self.edges: Dict[str, Proc] = {}
        self.ports: Dict[str, int] = {}
        self.apis: List[Proc] = []
        self.node_ids = [f"c{os.getpid() % 100000}x{i}" for i in range(3)]
        self.db = os.path.join(self.dir, "iam.db")

    def edge_argv(self, node: str) -> List[str]:
        return [self.dsec, "edge", "--listen", f"127.0.0.1:{self.ports[node]}",
                "--data-dir", os.path.join(self.dir, node), "--node-id", node,
                "--token", self.token, "--label", f"name={node}"]

    def start_edge(self, node: str) -> None:
        env = {}
        a = find_aether()
        if a:
            env["DSEC_AETHER"] = a
        self.edges[node] = Proc(self.edge_argv(node), ["DSEC_EDGE_URL"], env).start(timeout=120)

    def edge_specs(self) -> List[str]:
        return [f"http://127.0.0.1:{self.ports[n]}#{self.token}" for n in self.node_ids]

    def start_api(self, i: int) -> Proc:
        return apiserver(self.dsec, self.db, os.path.join(self.dir, f"env{i}-{self.backend}"),
                         self.edge_specs())

    def start(self) -> None:
        for n in self.node_ids:
            self.ports[n] = free_port()
            self.start_edge(n)

    def start_apis(self, backend: str, db: str) -> None:
        """(Re)starts both apiserver replicas on a fresh IAM database of `backend`."""
        self.stop_apis()
        self.backend, self.db = backend, db
        self.apis = [self.start_api(0), self.start_api(1)]

    def stop_apis(self) -> None:
        for a in self.apis:
            a.kill(signal.SIGTERM)
        self.apis = []

    def api(self, i: int) -> Tuple[str, str]:
        return self.apis[i].first("DSEC_API_URL"), self.apis[i].first("DSEC_API_KEY")

    def stop(self) -> None:
        self.stop_apis()
        for e in self.edges.values():
            e.kill(signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def edges3(dsec_bin):
    """The 3 real edges, shared by both backends' apiserver pairs."""
    c = Cluster(dsec_bin)
    c.backend = "sqlite"
    try:
        c.start()
    except RuntimeError as e:
        c.stop()
        pytest.fail(str(e), pytrace=False)
    yield c
    c.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def cluster(request, edges3):
    """2 apiserver replicas sharing one IAM database of each backend, over the same 3 edges."""
    db = backend_db(request, request.param, edges3.dir, "iam")
    try:
        edges3.start_apis(request.param, db)
    except RuntimeError as e:
        edges3.stop_apis()
        pytest.fail(str(e), pytrace=False)
    if request.param == "postgres":
        # Both replicas really share the PostgreSQL database: one bootstrap, one admin.
        pg = request.getfixturevalue("pg_server")
        assert pg.query(db, "SELECT COUNT(*) FROM principals") == "1"
    yield edges3
    edges3.stop_apis()


def create(url: str, key: str, **kw) -> Tuple[int, dict, dict]:
    body = {"image": "busybox"}
    body.update(kw)
    return call("POST", f"{url}/v1/sandboxes", key, body)


def nodes(url: str, key: str) -> Dict[str, dict]:
    st, body, _ = call("GET", f"{url}/v1/nodes", key)
    assert st == 200, body
    return {n["node"]: n for n in body["nodes"]}


def test_spread_and_either_replica_serves(cluster):
    (u0, k0), (u1, k1) = cluster.api(0), cluster.api(1)
    ids = []
    for i in range(9):
        st, sb, _ = create(u0 if i % 2 else u1, k0 if i % 2 else k1)
        assert st == 201, sb
        ids.append(sb["id"])
    used = {sb_id.split("-")[1] for sb_id in ids}
    assert len(used) >= 2, f"placement put all 9 sandboxes on {used}"
    for sid in ids:
        for u, k in ((u0, k0), (u1, k1)):
            st, info, _ = call("GET", f"{u}/v1/sandboxes/{sid}", k)
            assert st == 200 and info["id"] == sid, info
    st, out, _ = call("POST", f"{u1}/v1/sandboxes/{ids[0]}/exec", k1, {"argv": ["echo", "hi"]})
    assert st == 200 and out["stdout"] == "hi\n", out
    for sid in ids:
        call("DELETE", f"{u0}/v1/sandboxes/{sid}", k0)


def test_idempotent_create_across_replicas(cluster):
    (u0, k0), (u1, k1) = cluster.api(0), cluster.api(1)
    key = f"idem-{time.time()}"
    st, a, _ = create(u0, k0, idempotency_key=key)
    assert st == 201, a
    st, b, h = create(u1, k1, idempotency_key=key)
    assert st in (200, 201) and b["id"] == a["id"], (a, b)
    call("DELETE", f"{u0}/v1/sandboxes/{a['id']}", k0)


def test_quotas_hold_across_replicas_under_concurrent_creates(cluster):
    (u0, k0), (u1, k1) = cluster.api(0), cluster.api(1)
    proj = f"q{os.getpid()}-{cluster.backend[:2]}"
    st, body, _ = call("POST", f"{u0}/v1/projects", k0, {"name": proj, "quota": {"max_sandboxes": 4}})
    assert st == 201, body
    # Delegation: a child may not be given more than its parent has.
    st, body, _ = call("POST", f"{u1}/v1/projects", k1,
                       {"name": proj + "-c", "parent": proj, "quota": {"max_sandboxes": 10}})
    assert st == 400 and "parent" in body["error"]["message"], body
    st, created, _ = call("POST", f"{u0}/v1/keys", k0, {"principal": f"agent-{proj}", "project": proj})
    assert st == 201, created
    user_key = created["key"]
    results: List[Tuple[int, dict]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        st, body, _ = create(u0 if i % 2 else u1, user_key)
        with lock:
            results.append((st, body))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = [b for s, b in results if s == 201]
    refused = [b for s, b in results if s != 201]
    assert len(ok) == 4, results
    assert all(b["error"]["code"] == "quota_exceeded" for b in refused), refused
    # A user cannot charge a project outside its own.
    st, body, _ = create(u0, user_key, project="default")
    assert st == 403, body
    st, plist, _ = call("GET", f"{u1}/v1/projects", k1)
    usage = {p["name"]: p["usage"] for p in plist["projects"]}
    assert usage[proj]["sandboxes"] == 4
    for b in ok:
        st, _, _ = call("DELETE", f"{u1}/v1/sandboxes/{b['id']}", k1)
        assert st == 200
    assert wait_until(lambda: {p["name"]: p["usage"] for p in call("GET", f"{u0}/v1/projects", k0)[1]["projects"]}[proj]["sandboxes"] == 0, 5)
    st, again, _ = create(u1, user_key)
    assert st == 201, again
    call("DELETE", f"{u1}/v1/sandboxes/{again['id']}", k1)


def test_edge_killed_marked_unhealthy_then_rejoins(cluster):
    (u0, k0), (u1, k1) = cluster.api(0), cluster.api(1)
    victim = cluster.node_ids[2]
    st, sb, _ = create(u0, k0, labels={"node.name": victim})
    assert st == 201 and sb["node"] == victim, sb
    cluster.edges[victim].kill(signal.SIGKILL)
    for u, k in ((u0, k0), (u1, k1)):
        assert wait_until(lambda: not nodes(u, k)[victim]["healthy"], 5), f"{victim} still healthy"
    t = time.time()
    st, err, _ = call("GET", f"{u1}/v1/sandboxes/{sb['id']}", k1)
    assert st == 503 and err["error"]["code"] == "node_unavailable", err
    assert time.time() - t < 1.0, "a call to a dead node must fail fast"
    placed = []
    for _ in range(6):
        st, other, _ = create(u1, k1)
        assert st == 201, other
        placed.append(other)
    assert all(o["node"] != victim for o in placed), placed
    cluster.start_edge(victim)  # same data dir: re-adopts its live sandboxes
    for u, k in ((u0, k0), (u1, k1)):
        assert wait_until(lambda: nodes(u, k)[victim]["healthy"], 10), f"{victim} did not rejoin"
    st, info, _ = call("GET", f"{u0}/v1/sandboxes/{sb['id']}", k0)
    assert st == 200 and info["state"] == "running", info
    for o in placed + [sb]:
        call("DELETE", f"{u0}/v1/sandboxes/{o['id']}", k0)


def test_restarted_apiserver_rebuilds_its_view(cluster):
    u0, k0 = cluster.api(0)
    st, sb, _ = create(u0, k0)
    assert st == 201, sb
    cluster.apis[1].kill(signal.SIGKILL)
    cluster.apis[1] = cluster.start_api(1)
    u1, k1 = cluster.api(1)
    view = nodes(u1, k1)
    assert set(view) == set(cluster.node_ids) and all(n["healthy"] for n in view.values()), view
    assert sum(n["sandboxes_running"] for n in view.values()) >= 1
    st, info, _ = call("GET", f"{u1}/v1/sandboxes/{sb['id']}", k1)
    assert st == 200, info
    call("DELETE", f"{u1}/v1/sandboxes/{sb['id']}", k1)


# ---------------------------------------------------------------------------------------------
# simulated edges (test/benchmark mode)


def sim_edges(dsec: str, count: int, capacity: int, *labels: str) -> Proc:
    argv = [dsec, "edge", "--simulated", "--count", str(count), "--capacity", str(capacity),
            "--listen", "127.0.0.1:0", "--node-id", f"s{os.getpid() % 1000}x{len(labels)}"]
    for l in labels:
        argv += ["--label", l]
    p = Proc(argv, ["DSEC_EDGE_TOKEN"]).start()
    return p


def specs(p: Proc) -> List[str]:
    return [f"{u}#{p.first('DSEC_EDGE_TOKEN')}" for u in p.vars["DSEC_EDGE_URL"]]


def test_apiserver_db_as_sqlite_url_and_node_errors(dsec_bin):
    """`--db sqlite:///PATH` (the README's form) starts and keeps its env file beside PATH; a
    sandbox of a node no edge is answers 404 on every route, one of a known node that stopped
    answering 503."""
    d = tempfile.mkdtemp(prefix="dsec-sqliteurl-")
    edge = sim_edges(dsec_bin, 1, 10)
    api = None
    try:
        db = os.path.join(d, "state", "iam.db")
        argv = [dsec_bin, "apiserver", "--listen", f"127.0.0.1:{free_port()}", "--db", f"sqlite://{db}",
                "--watcher-period-ms", "200"] + sum((["--edge", e] for e in specs(edge)), [])
        api = Proc(argv, ["DSEC_API_URL", "DSEC_API_KEY"]).start()
        u, k = api.first("DSEC_API_URL"), api.first("DSEC_API_KEY")
        assert os.path.isfile(db), f"no database at {db}: {os.listdir(d)}"
        env_file = os.path.join(d, "state", "env")
        with open(env_file) as f:
            assert f"DSEC_API_KEY={k}" in f.read()
        assert not glob.glob(os.path.join(d, "sqlite:*")) and not os.path.exists("sqlite:")
        st, sb, _ = create(u, k)
        assert st == 201, sb
        ghost = "sb-0-0000000000000000"
        for method, path, body in (("GET", "", None), ("DELETE", "", None), ("POST", "/shell", {"cmd": "true"}),
                                   ("POST", "/exec", {"argv": ["true"]}), ("POST", "/pause", None),
                                   ("POST", "/resume", None), ("GET", "/files?path=/etc/hostname", None)):
            st, err, _ = call(method, f"{u}/v1/sandboxes/{ghost}{path}", k, body)
            assert st == 404 and err["error"]["code"] == "sandbox_not_found", (method, path, st, err)
        edge.kill(signal.SIGKILL)
        assert wait_until(lambda: call("GET", f"{u}/v1/sandboxes/{sb['id']}", k)[0] == 503, timeout=20)
        st, err, _ = call("GET", f"{u}/v1/sandboxes/{sb['id']}", k)
        assert err["error"]["code"] == "node_unavailable", err
    finally:
        if api:
            api.kill(signal.SIGTERM)
        edge.kill(signal.SIGTERM)
        shutil.rmtree(d, ignore_errors=True)


def test_overflow_kicks_in_above_threshold(dsec_bin):
    d = tempfile.mkdtemp(prefix="dsec-overflow-")
    primary = sim_edges(dsec_bin, 2, 10)
    overflow = sim_edges(dsec_bin, 1, 100, "pool=overflow")
    api = None
    try:
        api = apiserver(dsec_bin, os.path.join(d, "iam.db"), os.path.join(d, "env"),
                        specs(primary) + specs(overflow))
        u, k = api.first("DSEC_API_URL"), api.first("DSEC_API_KEY")
        over_node = overflow.first("DSEC_EDGE_URL")
        over_id = [n for n, v in nodes(u, k).items() if v["url"] == over_node][0]
        got = []
        for _ in range(17):  # at 16 of 20 the pool is at 80%, not above: the 17th stays primary
            st, sb, h = create(u, k, overflow_eligible=True)
            assert st == 201, sb
            got.append(sb["node"])
        assert over_id not in got, got
        st, sb, h = create(u, k, overflow_eligible=True)
        assert st == 201 and sb["node"] == over_id and h.get("x-dsec-pool") == "overflow", (sb, h)
        st, sb, h = create(u, k)  # not eligible: stays in the primary pool
        assert st == 201 and sb["node"] != over_id, sb
        st, view, _ = call("GET", f"{u}/v1/cluster", k)
        assert view["overflow_placements_total"] == 1 and view["primary_utilisation"] > 0.8, view
    finally:
        if api:
            api.kill(signal.SIGTERM)
        primary.kill(signal.SIGTERM)
        overflow.kill(signal.SIGTERM)
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_burst_of_32000_creates_none_lost_or_duplicated(dsec_bin, request, backend):
    d = tempfile.mkdtemp(prefix="dsec-burst-")
    edges = sim_edges(dsec_bin, 8, 3000)  # room for 24,000: the rest must be refused clearly
    api = None
    try:
        db = backend_db(request, backend, d, "burst")
        api = apiserver(dsec_bin, db, os.path.join(d, "env"), specs(edges))
        u, k = api.first("DSEC_API_URL"), api.first("DSEC_API_KEY")
        out = subprocess.run([dsec_bin, "bench", "create-load", "--total", "32000", "--concurrency", "256",
                              "--idempotency-prefix", f"burst{os.getpid()}"],
                             env=dict(os.environ, DSEC_API_URL=u, DSEC_API_KEY=k),
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        s = json.loads(out.stdout)
        refused = sum(s["refused"].values())
        assert s["created"] + refused == 32000, s
        assert s["duplicate_ids"] == 0, s
        assert set(s["refused"]) <= {"node_full"}, s["refused"]
        # Every sandbox the client was told about exists, and nothing else does.
        assert wait_until(lambda: sum(n["sandboxes_running"] for n in nodes(u, k).values()) == s["created"], 5)
        assert s["created"] >= 23000, s
        # Refused creates give their reservation back asynchronously (fire and forget):
        # usage converges on exactly what was created.
        def usage() -> Dict[str, int]:
            st, plist, _ = call("GET", f"{u}/v1/projects", k)
            return {p["name"]: p["usage"]["sandboxes"] for p in plist["projects"]}
        assert wait_until(lambda: usage()["default"] == s["created"], 10), usage()
        if backend == "postgres":
            # The ledger really is in PostgreSQL: one allocation row per live sandbox.
            pg = request.getfixturevalue("pg_server")
            assert pg.query(db, "SELECT COUNT(*) FROM allocations WHERE sandbox_id IS NOT NULL") == str(s["created"])
    finally:
        if api:
            api.kill(signal.SIGTERM)
        edges.kill(signal.SIGTERM)
        shutil.rmtree(d, ignore_errors=True)
