//! Small parsers for command-line arguments.

use std::fmt;

/// One side of `dsec cp`: a local path or `ID:/path` inside a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpPath {
    Local(String),
    Remote { id: String, path: String },
}

impl fmt::Display for CpPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CpPath::Local(p) => write!(f, "{p}"),
            CpPath::Remote { id, path } => write!(f, "{id}:{path}"),
        }
    }
}

/// `sb-...:/abs/path` is remote (the id must be well-formed, the path absolute); anything else
/// is local (so `./a:b` and `/tmp/x:y` stay local).
pub fn parse_cp_path(s: &str) -> CpPath {
    if let Some((id, path)) = s.split_once(':') {
        if dsec_wire::id::is_valid_sandbox_id(id) && path.starts_with('/') {
            return CpPath::Remote {
                id: id.to_string(),
                path: path.to_string(),
            };
        }
    }
    CpPath::Local(s.to_string())
}

/// `K=V` (for `--env` and `--label`); the key must be non-empty.
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Human-readable size in binary units.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cp_paths() {
        assert_eq!(
            parse_cp_path("sb-n0-3f9a2c01d4e5b6a7:/etc/hosts"),
            CpPath::Remote {
                id: "sb-n0-3f9a2c01d4e5b6a7".into(),
                path: "/etc/hosts".into()
            }
        );
        assert_eq!(parse_cp_path("./a:b"), CpPath::Local("./a:b".into()));
        assert_eq!(
            parse_cp_path("/tmp/x:/y"),
            CpPath::Local("/tmp/x:/y".into())
        );
        assert_eq!(
            parse_cp_path("sb-n0-3f9a2c01d4e5b6a7:rel"),
            CpPath::Local("sb-n0-3f9a2c01d4e5b6a7:rel".into())
        );
        assert_eq!(parse_cp_path("file"), CpPath::Local("file".into()));
        assert_eq!(
            parse_cp_path("sb-n0-3f9a2c01d4e5b6a7:/a:b").to_string(),
            "sb-n0-3f9a2c01d4e5b6a7:/a:b"
        );
    }

    #[test]
    fn kv() {
        assert_eq!(parse_kv("A=b=c"), Ok(("A".into(), "b=c".into())));
        assert_eq!(parse_kv("A="), Ok(("A".into(), "".into())));
        assert!(parse_kv("=x").is_err());
        assert!(parse_kv("novalue").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(human_bytes(5), "5 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
    }
}
