//! The `env` file written by `dsec up` (`DSEC_API_URL=...`, `DSEC_API_KEY=...`, mode 0600).

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::Context;

/// Writes `KEY=VALUE` lines atomically with mode 0600.
pub fn write(path: &Path, vars: &[(&str, &str)]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("create {}", tmp.display()))?;
    for (k, v) in vars {
        writeln!(f, "{k}={v}").with_context(|| format!("write {}", tmp.display()))?;
    }
    f.sync_all()
        .with_context(|| format!("sync {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename to {}", path.display()))?;
    Ok(())
}

/// Reads `KEY=VALUE` lines (blank lines and `#` comments skipped, `export ` prefix allowed).
pub fn read(path: &Path) -> std::io::Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path)?;
    Ok(parse(&text))
}

pub fn parse(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let l = l.strip_prefix("export ").unwrap_or(l);
            l.split_once('=')
                .map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn round_trip_0600() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("env");
        write(
            &p,
            &[("DSEC_API_URL", "http://x"), ("DSEC_API_KEY", "dsk_1")],
        )
        .unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let m = read(&p).unwrap();
        assert_eq!(m["DSEC_API_KEY"], "dsk_1");
        write(&p, &[("DSEC_API_KEY", "dsk_2")]).unwrap();
        assert_eq!(read(&p).unwrap()["DSEC_API_KEY"], "dsk_2");
        assert_eq!(parse("# c\nexport A=\"b\"\n")["A"], "b");
    }
}
