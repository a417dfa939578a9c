//! Deterministic replay: what a re-executed call is compared on, and how differences read.
//!
//! `dsec replay` starts a fresh sandbox from the recorded image and limits, re-executes the
//! recorded calls in `seq` order and asks [`diff`] for each one. Times (`duration_ms`,
//! `mtime`) are never compared; outputs kept by digest are compared by digest.

use dsec_wire::api::{CommandResult, ErrorDetail, FileInfo, FileList, TrajectoryRecord};

use super::sha256_hex;

/// What the re-executed call answered.
#[derive(Debug, Clone)]
pub enum Observed {
    Command(CommandResult),
    Content(Vec<u8>),
    Info(FileInfo),
    List(FileList),
    Done,
    Error(ErrorDetail),
}

/// Kinds `dsec replay` re-executes; the others (create, stop, pause, ...) are context.
pub fn is_replayable(kind: &str) -> bool {
    matches!(
        kind,
        "shell" | "exec" | "write_file" | "read_file" | "list_files" | "stat" | "remove" | "mkdir"
    )
}

fn short(s: &str) -> String {
    let mut t: String = s.chars().take(120).collect();
    if t.len() < s.len() {
        t.push('…');
    }
    format!("{t:?}")
}

fn out_diff(
    name: &str,
    rec: &TrajectoryRecord,
    recorded: &str,
    now_bytes: &[u8],
    now_text: &str,
) -> Option<String> {
    match rec.blobs.get(name) {
        Some(d) => (sha256_hex(now_bytes) != *d).then(|| {
            format!(
                "{name}: recorded sha256 {}…, now {}",
                &d[..12.min(d.len())],
                short(now_text)
            )
        }),
        None => (recorded != now_text).then(|| {
            format!(
                "{name}: recorded {}, now {}",
                short(recorded),
                short(now_text)
            )
        }),
    }
}

/// The differences between a record and the re-execution (empty: same result).
pub fn diff(rec: &TrajectoryRecord, now: &Observed) -> Vec<String> {
    let mut d = Vec::new();
    match (&rec.error, now) {
        (Some(e), Observed::Error(n)) => {
            if e.code != n.code {
                d.push(format!("error: recorded {}, now {}", e.code, n.code));
            }
            return d;
        }
        (Some(e), _) => {
            d.push(format!(
                "recorded error {} ({}), now it succeeded",
                e.code,
                short(&e.message)
            ));
            return d;
        }
        (None, Observed::Error(n)) => {
            d.push(format!(
                "recorded success, now error {} ({})",
                n.code,
                short(&n.message)
            ));
            return d;
        }
        _ => {}
    }
    match now {
        Observed::Command(c) => {
            let r: CommandResult = match serde_json::from_value(rec.result.clone()) {
                Ok(r) => r,
                Err(e) => return vec![format!("unreadable recorded result: {e}")],
            };
            if r.exit_code != c.exit_code {
                d.push(format!(
                    "exit_code: recorded {}, now {}",
                    r.exit_code, c.exit_code
                ));
            }
            if r.signal != c.signal {
                d.push(format!(
                    "signal: recorded {:?}, now {:?}",
                    r.signal, c.signal
                ));
            }
            if r.timed_out != c.timed_out {
                d.push(format!(
                    "timed_out: recorded {}, now {}",
                    r.timed_out, c.timed_out
                ));
            }
            let now_out = super::bytes_of(&c.stdout, &c.stdout_b64);
            d.extend(out_diff("stdout", rec, &r.stdout, &now_out, &c.stdout));
            let now_err = super::bytes_of(&c.stderr, &c.stderr_b64);
            d.extend(out_diff("stderr", rec, &r.stderr, &now_err, &c.stderr));
        }
        Observed::Content(bytes) => {
            let recorded = rec
                .result
                .get("sha256")
                .and_then(|v| v.as_str())
                .unwrap_or("");
            let now = sha256_hex(bytes);
            if !recorded.is_empty() && recorded != now {
                d.push(format!(
                    "content: recorded sha256 {}…, now {}… ({} bytes)",
                    &recorded[..12.min(recorded.len())],
                    &now[..12],
                    bytes.len()
                ));
            }
        }
        Observed::Info(i) => {
            if let Ok(r) = serde_json::from_value::<FileInfo>(rec.result.clone()) {
                if (r.kind, r.size, r.mode, r.uid, r.gid) != (i.kind, i.size, i.mode, i.uid, i.gid)
                {
                    d.push(format!(
                        "file info: recorded {:?} {} bytes mode {:o} uid {} gid {}, now {:?} {} bytes mode {:o} uid {} gid {}",
                        r.kind, r.size, r.mode, r.uid, r.gid, i.kind, i.size, i.mode, i.uid, i.gid
                    ));
                }
            }
        }
        Observed::List(l) => {
            if let Ok(r) = serde_json::from_value::<FileList>(rec.result.clone()) {
                let key = |l: &FileList| {
                    let mut v: Vec<(String, u64)> =
                        l.entries.iter().map(|e| (e.name.clone(), e.size)).collect();
                    v.sort();
                    v
                };
                if key(&r) != key(l) {
                    d.push(format!("listing: recorded {:?}, now {:?}", key(&r), key(l)));
                }
            }
        }
        Observed::Done | Observed::Error(_) => {}
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn shell_rec(stdout: &str, exit: i32) -> TrajectoryRecord {
        TrajectoryRecord {
            kind: "shell".into(),
            ok: true,
            result: serde_json::to_value(CommandResult {
                exit_code: exit,
                stdout: stdout.into(),
                duration_ms: 5.0,
                ..Default::default()
            })
            .unwrap(),
            ..Default::default()
        }
    }

    #[test]
    fn commands() {
        let now = |s: &str, e| {
            Observed::Command(CommandResult {
                exit_code: e,
                stdout: s.into(),
                duration_ms: 99.0,
                ..Default::default()
            })
        };
        assert!(
            diff(&shell_rec("a\n", 0), &now("a\n", 0)).is_empty(),
            "durations are not compared"
        );
        assert_eq!(diff(&shell_rec("a\n", 0), &now("b\n", 0)).len(), 1);
        assert_eq!(diff(&shell_rec("a\n", 0), &now("b\n", 1)).len(), 2);
        let mut big = shell_rec("", 0);
        big.blobs
            .insert("stdout".into(), sha256_hex(b"long output"));
        assert!(diff(&big, &now("long output", 0)).is_empty());
        assert_eq!(diff(&big, &now("other", 0)).len(), 1);
    }

    #[test]
    fn errors_and_files() {
        let mut r = TrajectoryRecord {
            kind: "read_file".into(),
            ok: true,
            result: json!({"sha256": sha256_hex(b"x"), "mode": 420, "size": 1}),
            ..Default::default()
        };
        assert!(diff(&r, &Observed::Content(b"x".to_vec())).is_empty());
        assert_eq!(diff(&r, &Observed::Content(b"y".to_vec())).len(), 1);
        let nf = ErrorDetail {
            code: "file_not_found".into(),
            message: "gone".into(),
        };
        assert_eq!(diff(&r, &Observed::Error(nf.clone())).len(), 1);
        r.error = Some(nf.clone());
        assert!(diff(&r, &Observed::Error(nf)).is_empty());
        assert!(is_replayable("shell") && !is_replayable("create"));
    }
}
