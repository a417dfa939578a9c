"""Function calls (issue 4): run code in a pre-warmed, isolated worker and get the verdict.

```python
async with DSecClient() as client:
    r = await client.call_function("python", "print(sum(range(100)))")
    assert r.status == "ok" and r.stdout == "4950\\n"
    j = await client.call_function("cpp", src, test_cases=[{"stdin": "1 2", "expected": "3"}])
    print(j.verdict)                     # "accepted", "wrong_answer", "time_limit_exceeded", ...
    many = await client.call_functions([{"language": "bash", "code": "echo $((6*7))"}] * 100)
```

A full queue raises :class:`dsec.QuotaExceeded` (HTTP 429) with ``retry_after_s`` set; the call
did not run. ``call_functions`` never gets 429 for its items: the server queues them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .errors import error_from_parts


@dataclass
class RunResult:
    status: str
    exit_code: int
    stdout: str
    stderr: str
    wall_ms: float
    cpu_ms: float
    peak_memory_bytes: int
    signal: Optional[int] = None
    verdict: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunResult":
        return cls(
            status=d.get("status", "sandbox_error"),
            exit_code=int(d.get("exit_code", -1)),
            stdout=d.get("stdout", ""),
            stderr=d.get("stderr", ""),
            wall_ms=float(d.get("wall_ms", 0.0)),
            cpu_ms=float(d.get("cpu_ms", 0.0)),
            peak_memory_bytes=int(d.get("peak_memory_bytes", 0)),
            signal=d.get("signal"),
            verdict=d.get("verdict"),
        )


@dataclass
class FunctionResult(RunResult):
    """stdout, stderr, exit code, status, wall/CPU time and peak memory of a call; in test-case
    mode also ``cases`` (one :class:`RunResult` with ``verdict`` each) and the overall ``verdict``."""

    compile: Optional[RunResult] = None
    cases: Optional[List[RunResult]] = None
    worker: str = ""
    queue_ms: float = 0.0
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FunctionResult":
        base = RunResult.from_dict(d)
        comp = d.get("compile")
        cases = d.get("cases")
        return cls(
            **base.__dict__,
            compile=RunResult.from_dict(comp) if comp else None,
            cases=[RunResult.from_dict(c) for c in cases] if cases is not None else None,
            worker=d.get("worker", ""),
            queue_ms=float(d.get("queue_ms", 0.0)),
            raw=dict(d),
        )


def call_body(
    language: str,
    code: str = "",
    stdin: Optional[str] = None,
    files: Optional[Mapping[str, str]] = None,
    args: Optional[Sequence[str]] = None,
    timeout: Optional[float] = None,
    memory_limit_mb: Optional[int] = None,
    image: Optional[str] = None,
    test_cases: Optional[Sequence[Mapping[str, str]]] = None,
    **extra: Any,
) -> Dict[str, Any]:
    """The JSON body of one call (``extra``: ``cpu_time_limit``, ``max_output``, ``pids_limit``,
    ``env``, ``command``, ``toolkits``, ``compare`` = ``"exact"`` | ``"whitespace"``)."""
    body: Dict[str, Any] = {"language": language, "code": code}
    if stdin is not None:
        body["stdin"] = stdin
    if files:
        body["files"] = dict(files)
    if args:
        body["args"] = list(args)
    if timeout is not None:
        body["timeout"] = timeout
    if memory_limit_mb is not None:
        body["memory_limit_mb"] = memory_limit_mb
    if image is not None:
        body["image"] = image
    if test_cases is not None:
        body["test_cases"] = [dict(c) for c in test_cases]
    for k, v in extra.items():
        if v is not None:
            body[k] = v
    return body


def _http_timeout(body: Mapping[str, Any], cases: int = 1) -> float:
    per = float(body.get("timeout") or 10.0)
    return 60.0 + per * max(cases, 1) + 60.0


class FunctionsMixin:
    """Function-call methods of :class:`dsec.DSecClient`."""

    async def call_function(self, language: str, code: str = "", stdin: Optional[str] = None,
                            files: Optional[Mapping[str, str]] = None, args: Optional[Sequence[str]] = None,
                            timeout: Optional[float] = 10.0, memory_limit_mb: Optional[int] = None,
                            image: Optional[str] = None, test_cases: Optional[Sequence[Mapping[str, str]]] = None,
                            **extra: Any) -> FunctionResult:
        body = call_body(language, code, stdin, files, args, timeout, memory_limit_mb, image, test_cases, **extra)
        n = len(test_cases) if test_cases else 1
        resp = await self._request("POST", "/v1/functions/call", json_body=body,  # type: ignore[attr-defined]
                                   timeout=_http_timeout(body, n))
        return FunctionResult.from_dict(self._json(resp))  # type: ignore[attr-defined]

    async def call_functions(self, calls: Sequence[Mapping[str, Any]], concurrency: Optional[int] = None,
                             timeout: float = 3600.0) -> List[Any]:
        """Runs many calls (each a dict of :func:`call_body` arguments, or a full body) in one
        request; returns one :class:`FunctionResult` per call, or a :class:`dsec.DSecError` for a
        call that could not run (bad request, missing image, ...)."""
        bodies = [c if "language" in c and "code" in c else call_body(**c) for c in calls]
        req: Dict[str, Any] = {"calls": [dict(b) for b in bodies]}
        if concurrency is not None:
            req["concurrency"] = concurrency
        resp = await self._request("POST", "/v1/functions/batch", json_body=req,  # type: ignore[attr-defined]
                                   timeout=timeout)
        out: List[Any] = []
        for item in self._json(resp).get("results", []):  # type: ignore[attr-defined]
            if item.get("result") is not None:
                out.append(FunctionResult.from_dict(item["result"]))
            else:
                err = item.get("error") or {}
                out.append(error_from_parts(None, err.get("code"), err.get("message", "call failed")))
        return out

    async def function_pools(self) -> List[Dict[str, Any]]:
        """The node's warm pools: workers (ids), idle/busy counts, calls, rejections."""
        resp = await self._request("GET", "/v1/functions/pools")  # type: ignore[attr-defined]
        return list(self._json(resp).get("pools", []))  # type: ignore[attr-defined]


class SyncFunctionsMixin:
    """The same methods for :class:`dsec.sync.DSecClient`."""

    def call_function(self, language: str, code: str = "", **kw: Any) -> FunctionResult:
        return self._run(self._aclient.call_function(language, code, **kw))  # type: ignore[attr-defined]

    def call_functions(self, calls: Sequence[Mapping[str, Any]], concurrency: Optional[int] = None,
                       timeout: float = 3600.0) -> List[Any]:
        return self._run(self._aclient.call_functions(calls, concurrency, timeout))  # type: ignore[attr-defined]

    def function_pools(self) -> List[Dict[str, Any]]:
        return self._run(self._aclient.function_pools())  # type: ignore[attr-defined]
