//! `dsec image import|ls|rm`.

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
        ImageCommand::Rm(a) => {
            c.remove_image(&a.name)
                .await
                .with_context(|| format!("remove image {}", a.name))?;
            println!("{}", a.name);
            Ok(())
        }
    }
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
