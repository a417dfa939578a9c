//! `dsec project create|ls|set-quota` (admin).

use anyhow::Context;
use clap::{Args, Subcommand};
use dsec_client::Client;
use dsec_wire::admin::{CreateProjectRequest, Quota};

#[derive(Args, Debug, Clone)]
pub struct QuotaArgs {
    /// Most concurrent sandboxes.
    #[arg(long)]
    pub max_sandboxes: Option<u64>,
    /// Most CPU cores (sum of the sandboxes' limits).
    #[arg(long)]
    pub max_cpus: Option<f64>,
    /// Most memory in MiB (sum of the sandboxes' limits).
    #[arg(long)]
    pub max_memory_mb: Option<u64>,
    /// Most creations per second.
    #[arg(long)]
    pub max_creates_per_s: Option<u64>,
}

impl QuotaArgs {
    fn quota(&self) -> Quota {
        Quota {
            max_sandboxes: self.max_sandboxes,
            max_cpu_cores: self.max_cpus,
            max_memory_mb: self.max_memory_mb,
            max_creates_per_s: self.max_creates_per_s,
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum ProjectCommand {
    /// Create a project under a parent (default `root`); its quota is delegated from the parent.
    Create {
        name: String,
        #[arg(long)]
        parent: Option<String>,
        #[command(flatten)]
        quota: QuotaArgs,
    },
    /// List projects with quota and usage.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Replace a project's quota (unset limits become unlimited; must fit in the parent's).
    SetQuota {
        name: String,
        #[command(flatten)]
        quota: QuotaArgs,
    },
}

/// A number as JSON prints it (`2.0` for a float), `-` for unlimited.
fn lim<T: Into<serde_json::Value>>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.into().to_string())
}

fn num<T: Into<serde_json::Value>>(v: T) -> String {
    v.into().to_string()
}

pub async fn project(c: &Client, cmd: ProjectCommand) -> anyhow::Result<()> {
    match cmd {
        ProjectCommand::Create {
            name,
            parent,
            quota,
        } => {
            let req = CreateProjectRequest {
                name: name.clone(),
                parent,
                quota: Some(quota.quota()),
            };
            let v = c
                .create_project(&req)
                .await
                .with_context(|| format!("create project {name}"))?;
            super::print_json(&v)
        }
        ProjectCommand::SetQuota { name, quota } => {
            let v = c
                .set_quota(&name, &quota.quota())
                .await
                .with_context(|| format!("set the quota of project {name}"))?;
            super::print_json(&v)
        }
        ProjectCommand::Ls { json } => {
            let l = c.projects().await.context("list projects")?;
            if json {
                return super::print_json(&l);
            }
            let rows: Vec<Vec<String>> = l
                .projects
                .iter()
                .map(|p| {
                    let (q, u) = (&p.quota, &p.usage);
                    vec![
                        p.name.clone(),
                        p.parent.clone().unwrap_or_else(|| "-".into()),
                        format!("{}/{}", num(u.sandboxes), lim(q.max_sandboxes)),
                        format!("{}/{}", num(u.cpu_cores), lim(q.max_cpu_cores)),
                        format!("{}/{}", num(u.memory_mb), lim(q.max_memory_mb)),
                        lim(q.max_creates_per_s),
                    ]
                })
                .collect();
            print!(
                "{}",
                crate::table::render(
                    &[
                        "PROJECT",
                        "PARENT",
                        "SANDBOXES",
                        "CPUS",
                        "MEMORY_MB",
                        "CREATES/S"
                    ],
                    &rows
                )
            );
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_print_as_before() {
        assert_eq!(lim::<u64>(None), "-");
        assert_eq!(lim(Some(3u64)), "3");
        assert_eq!(lim(Some(2.0f64)), "2.0");
        assert_eq!(num(0.5f64), "0.5");
    }
}
