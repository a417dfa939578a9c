//! Reading a log back: filters (step range, time, kind), JSONL export, and provenance — which
//! call last wrote a file.

use dsec_wire::api::TrajectoryRecord;
use serde::Deserialize;

/// Query of `GET /v1/sandboxes/{id}/trajectory`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Filter {
    /// Lowest step id (records without a step are left out when `from` or `to` is given).
    pub from: Option<u64>,
    /// Highest step id.
    pub to: Option<u64>,
    /// Comma-separated kinds (`shell,exec`).
    pub kind: Option<String>,
    /// Records that started at or after this Unix time (seconds, fractions allowed).
    pub since: Option<f64>,
    /// Records that started before this Unix time (seconds).
    pub until: Option<f64>,
    /// Only the records that (last) wrote this path: see [`provenance`].
    pub path: Option<String>,
}

impl Filter {
    /// Whether `r` passes the step, kind and time filters (`path` is handled by [`provenance`]).
    pub fn matches(&self, r: &TrajectoryRecord) -> bool {
        if self.from.is_some() || self.to.is_some() {
            match r.step {
                None => return false,
                Some(s) => {
                    if self.from.is_some_and(|f| s < f) || self.to.is_some_and(|t| s > t) {
                        return false;
                    }
                }
            }
        }
        if let Some(kinds) = &self.kind {
            if !kinds.split(',').any(|k| k.trim() == r.kind) {
                return false;
            }
        }
        if self.since.is_some_and(|s| r.start_ms < s * 1000.0) {
            return false;
        }
        if self.until.is_some_and(|u| r.start_ms >= u * 1000.0) {
            return false;
        }
        true
    }
}

/// One record per line.
pub fn to_jsonl(records: &[TrajectoryRecord]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        if let Ok(mut line) = serde_json::to_vec(r) {
            out.append(&mut line);
            out.push(b'\n');
        }
    }
    out
}

/// A JSONL trajectory that does not parse: the line (1-based) and why.
#[derive(Debug, thiserror::Error)]
#[error("line {line}: {source}")]
pub struct JsonlError {
    pub line: usize,
    pub source: serde_json::Error,
}

/// Parses JSONL (blank lines skipped); the error names the line.
pub fn parse_jsonl(text: &str) -> Result<Vec<TrajectoryRecord>, JsonlError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|source| JsonlError {
                line: i + 1,
                source,
            })
        })
        .collect()
}

/// Whether a record's own request named `path` as something it wrote.
fn api_wrote(r: &TrajectoryRecord, path: &str) -> bool {
    r.ok && (r.files_written.iter().any(|f| f.path == path)
        || (matches!(r.kind.as_str(), "mkdir" | "remove")
            && r.request.get("path").and_then(|p| p.as_str()) == Some(path)))
}

/// Which calls last wrote `path`.
///
/// Two sources, most recent wins: file-API calls name the paths they wrote; for anything else
/// (a shell command, a background process) the file's inode change time in the sandbox's
/// writable layer — set by the kernel on every write, and not settable from inside — is matched
/// against the calls' time spans. `changed_ns` is that change time (Unix ns) when the file is in
/// the writable layer of a live sandbox. Answers the matching records, newest first: normally
/// one; several when calls overlapped in time; none when nothing in the log explains the file.
pub fn provenance(
    records: &[TrajectoryRecord],
    path: &str,
    changed_ns: Option<i128>,
) -> Vec<TrajectoryRecord> {
    let last_api = records.iter().rev().find(|r| api_wrote(r, path));
    let Some(ns) = changed_ns else {
        return last_api.cloned().into_iter().collect();
    };
    let ms = ns as f64 / 1e6;
    // A file write that ended after the last API write of the path: slack of 1 ms for clocks.
    let by_time: Vec<TrajectoryRecord> = records
        .iter()
        .rev()
        .filter(|r| r.start_ms - 1.0 <= ms && ms <= r.end_ms + 1.0)
        .filter(|r| {
            !matches!(
                r.kind.as_str(),
                "read_file" | "list_files" | "stat" | "create"
            )
        })
        .cloned()
        .collect();
    match (last_api, by_time.is_empty()) {
        (Some(api), _) if by_time.iter().any(|r| r.seq == api.seq) => vec![api.clone()],
        (Some(api), true) => vec![api.clone()],
        (Some(api), false) if by_time.iter().all(|r| r.seq < api.seq) => vec![api.clone()],
        (_, false) => by_time,
        (None, true) => {
            // Written outside any call (a background process): the last call before it.
            records
                .iter()
                .rev()
                .find(|r| r.end_ms <= ms && r.kind != "create")
                .cloned()
                .into_iter()
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::api::FileDigest;
    use serde_json::json;

    fn r(seq: u64, step: Option<u64>, kind: &str, start: f64, end: f64) -> TrajectoryRecord {
        TrajectoryRecord {
            seq,
            step,
            kind: kind.into(),
            start_ms: start,
            end_ms: end,
            ok: true,
            ..Default::default()
        }
    }

    #[test]
    fn filters() {
        let recs = [
            r(1, None, "create", 1000.0, 1001.0),
            r(2, Some(1), "shell", 2000.0, 2001.0),
            r(3, Some(2), "exec", 3000.0, 3001.0),
        ];
        let f = Filter {
            from: Some(2),
            ..Default::default()
        };
        assert_eq!(recs.iter().filter(|x| f.matches(x)).count(), 1);
        let f = Filter {
            kind: Some("shell, create".into()),
            ..Default::default()
        };
        assert_eq!(
            recs.iter()
                .filter(|x| f.matches(x))
                .map(|x| x.seq)
                .collect::<Vec<_>>(),
            vec![1, 2]
        );
        let f = Filter {
            since: Some(2.0),
            until: Some(3.0),
            ..Default::default()
        };
        assert_eq!(
            recs.iter()
                .filter(|x| f.matches(x))
                .map(|x| x.seq)
                .collect::<Vec<_>>(),
            vec![2]
        );
        let text = String::from_utf8(to_jsonl(&recs)).unwrap();
        assert_eq!(parse_jsonl(&text).unwrap(), recs.to_vec());
        assert!(parse_jsonl("{}\nnot json")
            .unwrap_err()
            .to_string()
            .starts_with("line 1"));
    }

    #[test]
    fn provenance_sources() {
        let mut w = r(2, Some(1), "write_file", 2000.0, 2010.0);
        w.files_written = vec![FileDigest {
            path: "/a".into(),
            sha256: "x".into(),
            size: 1,
        }];
        let sh = r(3, Some(2), "shell", 3000.0, 3050.0);
        let mut mk = r(4, Some(3), "mkdir", 4000.0, 4001.0);
        mk.request = json!({"path": "/d"});
        let later = r(5, Some(4), "shell", 5000.0, 5001.0);
        let recs = vec![r(1, None, "create", 0.0, 1.0), w, sh, mk, later];
        // Only the API knows: the write.
        assert_eq!(provenance(&recs, "/a", None)[0].seq, 2);
        assert!(provenance(&recs, "/b", None).is_empty());
        // Changed during the shell command: the shell command.
        assert_eq!(provenance(&recs, "/a", Some(3_020_000_000))[0].seq, 3);
        // Changed during the write: the write.
        assert_eq!(provenance(&recs, "/a", Some(2_005_000_000))[0].seq, 2);
        // mkdir by path.
        assert_eq!(provenance(&recs, "/d", Some(4_000_500_000))[0].seq, 4);
        // Changed between calls (a background process): the last call before.
        assert_eq!(provenance(&recs, "/c", Some(4_500_000_000))[0].seq, 4);
    }
}
