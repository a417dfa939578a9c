//! `dsec volume create|ls|rm`: named persistent volumes of a project.

use anyhow::Context;
use clap::Subcommand;
use dsec_client::Client;

#[derive(Subcommand, Debug)]
pub enum VolumeCommand {
    /// Create a volume of SIZE_MB MiB (an ext4 file system kept on one node).
    Create {
        /// `[a-z0-9][a-z0-9-]{0,62}`, unique within the project.
        name: String,
        /// Size limit in MiB (writes past it fail with ENOSPC inside sandboxes).
        size_mb: u64,
        /// Project owning it (default: the API key's project).
        #[arg(long)]
        project: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// List the project's volumes.
    Ls {
        #[arg(long)]
        project: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Delete volumes and their data (refused while a sandbox has one mounted).
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
        #[arg(long)]
        project: Option<String>,
    },
}

pub async fn volume(c: &Client, cmd: VolumeCommand) -> anyhow::Result<()> {
    match cmd {
        VolumeCommand::Create {
            name,
            size_mb,
            project,
            json,
        } => {
            let v = c
                .create_volume(&name, size_mb, project.as_deref())
                .await
                .with_context(|| format!("create volume {name}"))?;
            if json {
                return super::print_json(&v);
            }
            println!("{}", v.name);
        }
        VolumeCommand::Ls { project, json } => {
            let vols = c
                .list_volumes(project.as_deref())
                .await
                .context("list volumes")?;
            if json {
                return super::print_json(&vols);
            }
            let rows: Vec<Vec<String>> = vols
                .iter()
                .map(|v| {
                    vec![
                        v.name.clone(),
                        v.size_mb.to_string(),
                        v.node.clone(),
                        v.project.clone(),
                        v.created_at.clone(),
                    ]
                })
                .collect();
            print!(
                "{}",
                crate::table::render(&["NAME", "SIZE_MB", "NODE", "PROJECT", "CREATED"], &rows)
            );
        }
        VolumeCommand::Rm { names, project } => {
            for n in names {
                c.delete_volume(&n, project.as_deref())
                    .await
                    .with_context(|| format!("delete volume {n}"))?;
                println!("{n}");
            }
        }
    }
    Ok(())
}
