//! `dsec cp SRC DST`: one side is `ID:/path`; streams; keeps the mode.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use dsec_client::Client;
use dsec_wire::api::FileKind;

use crate::parse::{parse_cp_path, CpPath};

#[derive(Args, Debug)]
pub struct CpArgs {
    /// Source: a local file (`-` = standard input) or ID:/path.
    pub src: String,
    /// Destination: a local path (`-` = standard output) or ID:/path.
    pub dst: String,
}

fn basename(p: &str) -> anyhow::Result<&str> {
    Path::new(p)
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| anyhow::anyhow!("{p} has no file name"))
}

pub async fn cp(c: &Client, a: CpArgs) -> anyhow::Result<()> {
    match (parse_cp_path(&a.src), parse_cp_path(&a.dst)) {
        (CpPath::Local(src), CpPath::Remote { id, path }) => upload(c, &src, &id, &path).await,
        (CpPath::Remote { id, path }, CpPath::Local(dst)) => download(c, &id, &path, &dst).await,
        (CpPath::Local(_), CpPath::Local(_)) => Err(crate::UsageError(
            "one side of `dsec cp` must be ID:/absolute/path inside a sandbox".into(),
        )
        .into()),
        (CpPath::Remote { .. }, CpPath::Remote { .. }) => Err(crate::UsageError(
            "`dsec cp` copies between this machine and a sandbox; copy through a local file".into(),
        )
        .into()),
    }
}

async fn upload(c: &Client, src: &str, id: &str, path: &str) -> anyhow::Result<()> {
    if src == "-" {
        let info = c
            .write_file(id, path, None, tokio::io::stdin(), None)
            .await
            .with_context(|| format!("write {id}:{path}"))?;
        eprintln!("{} bytes -> {id}:{}", info.size, info.path);
        return Ok(());
    }
    let meta = std::fs::metadata(src).with_context(|| format!("read {src}"))?;
    if meta.is_dir() {
        return Err(crate::UsageError(format!(
            "{src} is a directory; `dsec cp` copies single files (archive it, copy the archive, unpack with `dsec exec`)"
        ))
        .into());
    }
    // Into an existing directory (or a path ending in '/'): keep the file name.
    let mut target = path.to_string();
    let is_dir =
        path.ends_with('/') || matches!(c.stat(id, path).await, Ok(fi) if fi.kind == FileKind::Dir);
    if is_dir {
        target = format!("{}/{}", path.trim_end_matches('/'), basename(src)?);
    }
    let info = c
        .write_file_from_path(id, &target, Path::new(src), None)
        .await
        .with_context(|| format!("copy {src} to {id}:{target}"))?;
    eprintln!("{} bytes -> {id}:{}", info.size, info.path);
    Ok(())
}

async fn download(c: &Client, id: &str, path: &str, dst: &str) -> anyhow::Result<()> {
    if dst == "-" {
        let mut out = tokio::io::stdout();
        c.read_file(id, path, &mut out)
            .await
            .with_context(|| format!("read {id}:{path}"))?;
        return Ok(());
    }
    let mut target = PathBuf::from(dst);
    if dst.ends_with('/') || target.is_dir() {
        target = target.join(basename(path)?);
    }
    let n = match c.read_file_to_path(id, path, &target).await {
        Ok(n) => n,
        Err(e) => {
            // Do not leave a partial file behind (the client creates it only once the
            // sandbox answered, so an API error leaves an existing file untouched).
            if !matches!(e, dsec_client::ClientError::Api { .. }) {
                let _ = std::fs::remove_file(&target);
            }
            return Err(e).with_context(|| format!("copy {id}:{path} to {}", target.display()));
        }
    };
    eprintln!("{id}:{path} -> {} ({n} bytes)", target.display());
    Ok(())
}
