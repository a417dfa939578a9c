//! `dsec image import|pull|fold|alias|ls|rm`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::{Args, Subcommand};
use dsec_client::Client;
use futures::StreamExt;

use crate::parse::human_bytes;

#[derive(Subcommand, Debug)]
pub enum ImageCommand {
    /// Import an image from a directory (archived on the fly) or a tar file (gzip accepted).
    Import(ImportArgs),
    /// Pull an image from an OCI registry (distribution API v2) onto the node, with progress.
    Pull(PullArgs),
    /// Merge consecutive small layers of an image into one layer (same visible tree).
    Fold(FoldArgs),
    /// Give an image a second name (e.g. an E2B template name: `dsec image alias base debian`).
    Alias(AliasArgs),
    /// List images.
    Ls(LsArgs),
    /// Remove an image.
    Rm(RmArgs),
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// Image name (`name` or `name:tag`).
    pub name: String,
    /// Root file system directory.
    #[arg(long, conflicts_with_all = ["tar", "oci", "docker_archive"], required_unless_present_any = ["tar", "oci", "docker_archive"])]
    pub dir: Option<PathBuf>,
    /// Tar file (`-` for standard input).
    #[arg(long, conflicts_with_all = ["oci", "docker_archive"])]
    pub tar: Option<PathBuf>,
    /// OCI image layout directory (as `skopeo copy ... oci:DIR` writes it); keeps its layers.
    #[arg(long, conflicts_with = "docker_archive")]
    pub oci: Option<PathBuf>,
    /// `docker save` archive (`-` for standard input); keeps its layers.
    #[arg(long)]
    pub docker_archive: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct PullArgs {
    /// `HOST[:PORT]/REPO[:TAG|@sha256:DIGEST]`.
    pub reference: String,
    /// Local image name (default: the reference's REPO:TAG).
    #[arg(long)]
    pub name: Option<String>,
    /// Plain HTTP to a registry that is not on loopback. Without it (and without an
    /// `http://` prefix) such a registry is reached over TLS; `https://HOST/...` forces TLS
    /// for a loopback registry too.
    #[arg(long)]
    pub insecure: bool,
    /// PEM file of CA certificate(s) to trust for the registry's TLS, besides the system's
    /// roots (for a registry behind a private CA).
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// Registry user (the password is read from DSEC_REGISTRY_PASSWORD).
    #[arg(long)]
    pub username: Option<String>,
}

#[derive(Args, Debug)]
pub struct AliasArgs {
    /// The new name (`name` or `name:tag`).
    pub name: String,
    /// The image it names.
    pub target: String,
}

#[derive(Args, Debug)]
pub struct FoldArgs {
    pub name: String,
    /// Fold runs of layers each smaller than this (bytes, or with a K/M/G suffix).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    pub max_layer_size: u64,
    /// Register the result under this name instead of replacing the image.
    #[arg(long)]
    pub into: Option<String>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 1 << 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("bad size {s:?}: use a number with an optional K, M or G suffix"))
}

/// `REPO:TAG` of a registry reference (`host/team/app:v1` → `team/app:v1`).
fn local_name(reference: &str) -> String {
    let r = reference
        .strip_prefix("https://")
        .or_else(|| reference.strip_prefix("http://"))
        .unwrap_or(reference);
    let rest = r.split_once('/').map(|(_, p)| p).unwrap_or(r);
    match rest.split_once('@') {
        Some((repo, _)) => repo.to_string(),
        None => rest.to_string(),
    }
}

#[derive(Args, Debug)]
pub struct LsArgs {
    #[arg(long)]
    pub json: bool,
    /// One row per layer: digest, metadata/data sizes, users, parent image.
    #[arg(long)]
    pub layers: bool,
}

#[derive(Args, Debug)]
pub struct RmArgs {
    pub name: String,
}

pub async fn image(c: &Client, cmd: ImageCommand) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Import(a) => import(c, a).await,
        ImageCommand::Ls(a) => ls(c, a).await,
        ImageCommand::Pull(a) => pull(c, a).await,
        ImageCommand::Fold(a) => {
            let req = dsec_wire::api::ImageActionRequest::Fold {
                max_layer_bytes: Some(a.max_layer_size),
                into: a.into.clone(),
            };
            let before = c.images().await.context("list images")?;
            let n_before = before
                .images
                .iter()
                .find(|i| dsec_image_name_eq(&i.name, &a.name))
                .map(|i| i.layers.len());
            let info = c
                .image_action(&a.name, &req)
                .await
                .with_context(|| format!("fold image {}", a.name))?;
            eprintln!(
                "folded {}: {} -> {} layer(s), {}",
                a.name,
                n_before
                    .map(|n| n.to_string())
                    .unwrap_or_else(|| "?".into()),
                info.layers.len(),
                human_bytes(info.size_bytes)
            );
            println!("{}", info.name);
            Ok(())
        }
        ImageCommand::Alias(a) => {
            let req = dsec_wire::api::ImageActionRequest::Alias {
                target: a.target.clone(),
            };
            let info = c
                .image_action(&a.name, &req)
                .await
                .with_context(|| format!("alias image {} to {}", a.name, a.target))?;
            eprintln!(
                "{} -> {} ({} layer(s), {})",
                info.name,
                a.target,
                info.layers.len(),
                human_bytes(info.size_bytes)
            );
            println!("{}", info.name);
            Ok(())
        }
        ImageCommand::Rm(a) => {
            c.remove_image(&a.name)
                .await
                .with_context(|| format!("remove image {}", a.name))?;
            println!("{}", a.name);
            Ok(())
        }
    }
}

/// `name` and `name:latest` are the same image.
fn dsec_image_name_eq(listed: &str, given: &str) -> bool {
    listed == given || (!given.contains(':') && listed == format!("{given}:latest"))
}

async fn pull(c: &Client, a: PullArgs) -> anyhow::Result<()> {
    use dsec_wire::api::ImageActionEvent as E;
    let name = a.name.clone().unwrap_or_else(|| local_name(&a.reference));
    let password = std::env::var("DSEC_REGISTRY_PASSWORD").ok();
    let ca_pem = match &a.ca_file {
        Some(p) => {
            let pem = std::fs::read_to_string(p).map_err(|e| {
                crate::UsageError(format!("--ca-file {}: cannot read it: {e}", p.display()))
            })?;
            dsec_image::registry::parse_ca_pem(&pem)
                .map_err(|m| crate::UsageError(format!("--ca-file {}: {m}", p.display())))?;
            Some(pem)
        }
        None => None,
    };
    let req = dsec_wire::api::ImageActionRequest::Pull {
        reference: a.reference.clone(),
        insecure: a.insecure,
        username: a.username.clone(),
        password,
        ca_pem,
    };
    let tty = std::io::stderr().is_terminal();
    let started = Instant::now();
    let mut total_layers = 0u64;
    let info = c
        .image_action_progress(&name, &req, |ev| match ev {
            E::Manifest {
                digest,
                layers,
                bytes,
            } => {
                total_layers = *layers;
                eprintln!(
                    "manifest {digest}: {layers} layer(s), {}",
                    human_bytes(*bytes)
                );
            }
            E::Download {
                layer, done, total, ..
            } => {
                let line = format!(
                    "layer {layer}/{total_layers}: {} / {}",
                    human_bytes(*done),
                    human_bytes(*total)
                );
                if tty {
                    eprint!("\r\x1b[K{line}");
                } else if done == total {
                    eprintln!("{line}");
                }
            }
            E::Build { layer } => {
                if tty {
                    eprint!("\r\x1b[K");
                }
                eprintln!("building layer {layer}/{total_layers}");
            }
            E::Done { .. } | E::Error { .. } => {}
        })
        .await
        .with_context(|| format!("pull {} into image {name}", a.reference))?;
    eprintln!(
        "pulled {}: {} layer(s), {} in {:.1}s",
        info.name,
        info.layers.len(),
        human_bytes(info.size_bytes),
        started.elapsed().as_secs_f64()
    );
    println!("{}", info.name);
    Ok(())
}

type ByteStream = futures::stream::BoxStream<'static, std::io::Result<Bytes>>;

async fn import(c: &Client, a: ImportArgs) -> anyhow::Result<()> {
    let (format, dir, tar) = match (&a.oci, &a.docker_archive) {
        (Some(d), _) => ("oci", Some(d), None),
        (None, Some(f)) => ("docker-archive", None, Some(f)),
        (None, None) => ("tar", a.dir.as_ref(), a.tar.as_ref()),
    };
    let (source, stream): (String, ByteStream) = match (dir, tar) {
        (Some(dir), _) => {
            let meta = std::fs::metadata(dir).with_context(|| format!("read {}", dir.display()))?;
            if !meta.is_dir() {
                return Err(crate::UsageError(format!(
                    "--dir {} is not a directory",
                    dir.display()
                ))
                .into());
            }
            let rx = crate::tarball::stream_dir(dir.clone());
            let s =
                futures::stream::unfold(
                    rx,
                    |mut rx| async move { rx.recv().await.map(|x| (x, rx)) },
                );
            (dir.display().to_string(), s.boxed())
        }
        (None, Some(tar)) if tar.as_os_str() == "-" => (
            "standard input".into(),
            tokio_util::io::ReaderStream::with_capacity(tokio::io::stdin(), 256 * 1024).boxed(),
        ),
        (None, Some(tar)) => {
            let f = tokio::fs::File::open(tar)
                .await
                .with_context(|| format!("open {}", tar.display()))?;
            (
                tar.display().to_string(),
                tokio_util::io::ReaderStream::with_capacity(f, 256 * 1024).boxed(),
            )
        }
        (None, None) => {
            return Err(crate::UsageError("pass --dir PATH or --tar FILE".into()).into())
        }
    };
    let sent = Arc::new(AtomicU64::new(0));
    let counted = {
        let sent = sent.clone();
        stream.inspect(move |r| {
            if let Ok(b) = r {
                sent.fetch_add(b.len() as u64, Ordering::Relaxed);
            }
        })
    };
    let started = Instant::now();
    let progress = std::io::stderr().is_terminal().then(|| {
        let sent = sent.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let n = sent.load(Ordering::Relaxed);
                let secs = started.elapsed().as_secs_f64().max(1e-3);
                eprint!(
                    "\r\x1b[Ksent {} ({}/s)",
                    human_bytes(n),
                    human_bytes((n as f64 / secs) as u64)
                );
            }
        })
    });
    let reader = tokio_util::io::StreamReader::new(counted);
    let result = c.import_image_as(&a.name, format, reader).await;
    if let Some(p) = progress {
        p.abort();
        eprint!("\r\x1b[K");
    }
    let n = sent.load(Ordering::Relaxed);
    let secs = started.elapsed().as_secs_f64();
    let info = result.with_context(|| format!("import image {} from {source}", a.name))?;
    eprintln!(
        "imported {}: {} layer(s), {} (sent {} in {:.1}s, {}/s)",
        info.name,
        info.layers.len(),
        human_bytes(info.size_bytes),
        human_bytes(n),
        secs,
        human_bytes((n as f64 / secs.max(1e-3)) as u64)
    );
    println!("{}", info.name);
    Ok(())
}

async fn ls(c: &Client, a: LsArgs) -> anyhow::Result<()> {
    let list = c.images().await.context("list images")?;
    if a.json {
        return super::print_json(&list);
    }
    if a.layers {
        let mut rows = Vec::new();
        for i in &list.images {
            for (n, l) in i.layers.iter().enumerate() {
                rows.push(vec![
                    i.name.clone(),
                    n.to_string(),
                    l.digest.chars().take(12).collect(),
                    human_bytes(l.meta_bytes),
                    human_bytes(l.blob_bytes),
                    l.users.to_string(),
                    i.parent.clone().unwrap_or_else(|| "-".into()),
                    i.source.clone().unwrap_or_else(|| "-".into()),
                ]);
            }
        }
        print!(
            "{}",
            crate::table::render(
                &["IMAGE", "#", "LAYER", "META", "DATA", "USERS", "PARENT", "SOURCE"],
                &rows
            )
        );
        return Ok(());
    }
    let rows: Vec<Vec<String>> = list
        .images
        .iter()
        .map(|i| {
            vec![
                i.name.clone(),
                i.layers.len().to_string(),
                human_bytes(i.size_bytes),
                i.in_use.to_string(),
                i.created_at.clone(),
            ]
        })
        .collect();
    print!(
        "{}",
        crate::table::render(&["NAME", "LAYERS", "SIZE", "IN USE", "CREATED"], &rows)
    );
    Ok(())
}
