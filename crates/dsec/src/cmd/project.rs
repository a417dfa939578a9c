//! `dsec project create|ls|set-quota` (admin).

use clap::{Args, Subcommand};
use reqwest::Method;
use serde_json::json;

use super::bench::Api;

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
    fn json(&self) -> serde_json::Value {
        json!({
            "max_sandboxes": self.max_sandboxes,
            "max_cpu_cores": self.max_cpus,
            "max_memory_mb": self.max_memory_mb,
            "max_creates_per_s": self.max_creates_per_s,
        })
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

fn lim(v: &serde_json::Value) -> String {
    if v.is_null() {
        "-".into()
    } else {
        v.to_string()
    }
}

pub async fn project(api: &Api, c: ProjectCommand) -> anyhow::Result<()> {
    match c {
        ProjectCommand::Create {
            name,
            parent,
            quota,
        } => {
            let v = api
                .call(
                    Method::POST,
                    "/v1/projects",
                    Some(&json!({"name": name, "parent": parent, "quota": quota.json()})),
                )
                .await?;
            super::print_json(&v)
        }
        ProjectCommand::SetQuota { name, quota } => {
            let v = api
                .call(
                    Method::PUT,
                    &format!("/v1/projects/{name}/quota"),
                    Some(&quota.json()),
                )
                .await?;
            super::print_json(&v)
        }
        ProjectCommand::Ls { json } => {
            let v = api.call(Method::GET, "/v1/projects", None).await?;
            if json {
                return super::print_json(&v);
            }
            let empty = vec![];
            let rows: Vec<Vec<String>> = v["projects"]
                .as_array()
                .unwrap_or(&empty)
                .iter()
                .map(|p| {
                    let (q, u) = (&p["quota"], &p["usage"]);
                    vec![
                        p["name"].as_str().unwrap_or("").to_string(),
                        p["parent"].as_str().unwrap_or("-").to_string(),
                        format!("{}/{}", u["sandboxes"], lim(&q["max_sandboxes"])),
                        format!("{}/{}", u["cpu_cores"], lim(&q["max_cpu_cores"])),
                        format!("{}/{}", u["memory_mb"], lim(&q["max_memory_mb"])),
                        lim(&q["max_creates_per_s"]),
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
