//! `dsec pause`, `dsec resume` (by id, or every sandbox matching `--label K=V`), and the TTL
//! columns of `dsec ps`.

use std::collections::BTreeMap;

use anyhow::Context;
use clap::Args;
use dsec_client::Client;
use dsec_wire::api::{SandboxInfo, SandboxState, TtlAction};

use crate::parse::parse_kv;

#[derive(Args, Debug)]
pub struct PauseArgs {
    /// Sandbox ids.
    #[arg(required_unless_present = "labels")]
    pub ids: Vec<String>,
    /// Act on every sandbox whose labels include these (repeatable), on every node.
    #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Print JSON for scripts.
    #[arg(long)]
    pub json: bool,
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

async fn by_label(c: &Client, op: &str, a: &PauseArgs) -> anyhow::Result<()> {
    let labels: BTreeMap<String, String> = a.labels.iter().cloned().collect();
    let r = c
        .job_op(op, &labels)
        .await
        .with_context(|| format!("{op} sandboxes by label"))?;
    if a.json {
        super::print_json(&r)?;
    } else {
        println!(
            "{op}: {} matched, {} succeeded, {} failed in {:.0} ms",
            r.matched,
            r.succeeded,
            r.failed.len(),
            r.duration_ms
        );
        for f in &r.failed {
            eprintln!("dsec: {op} {}: {}", f.id, f.error.message);
        }
        if !r.unreachable_nodes.is_empty() {
            eprintln!(
                "dsec: nodes not reached: {}",
                r.unreachable_nodes.join(", ")
            );
        }
    }
    if r.failed.is_empty() && r.unreachable_nodes.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("{op} failed on some sandboxes or nodes")
    }
}

async fn by_id(c: &Client, op: &str, a: &PauseArgs) -> anyhow::Result<()> {
    let mut failed = 0;
    for id in &a.ids {
        let r = if op == "pause" {
            c.pause(id).await
        } else {
            c.resume(id).await
        };
        match r {
            Ok(info) if a.json => super::print_json(&info)?,
            Ok(info) => match (&info.last_pause, op) {
                (Some(p), "pause") => println!(
                    "{id} paused: memory {} -> {} ({})",
                    mib(p.memory_before_bytes),
                    mib(p.memory_after_bytes),
                    p.method
                ),
                _ => println!("{id} {}", state_name(info.state)),
            },
            Err(e) => {
                failed += 1;
                eprintln!("dsec: {op} {id}: {e}");
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} of {} sandboxes could not be {op}d", a.ids.len());
    }
    Ok(())
}

pub async fn pause(c: &Client, a: PauseArgs) -> anyhow::Result<()> {
    if a.labels.is_empty() {
        by_id(c, "pause", &a).await
    } else {
        by_label(c, "pause", &a).await
    }
}

pub async fn resume(c: &Client, a: PauseArgs) -> anyhow::Result<()> {
    if a.labels.is_empty() {
        by_id(c, "resume", &a).await
    } else {
        by_label(c, "resume", &a).await
    }
}

fn state_name(s: SandboxState) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Seconds since an RFC 3339 UTC time (`2026-01-31T12:00:00Z`), if it parses.
fn secs_since(t: &str) -> Option<u64> {
    let b = t.as_bytes();
    if b.len() < 20 {
        return None;
    }
    let n = |r: std::ops::Range<usize>| t.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let (hh, mm, ss) = (n(11..13)?, n(14..16)?, n(17..19)?);
    // Days from civil (Howard Hinnant).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let then = days * 86_400 + hh * 3600 + mm * 60 + ss;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_secs() as i64;
    u64::try_from(now - then).ok()
}

/// `idle/ttl action` for `dsec ps`, e.g. `12s/300s stop`, or `-`.
pub fn idle_ttl_column(s: &SandboxInfo) -> String {
    let idle = s
        .last_request_at
        .as_deref()
        .and_then(secs_since)
        .map_or("?".to_string(), |v| format!("{v}s"));
    match s.ttl_running_stop {
        Some(t) => {
            let action = match s.ttl_action {
                TtlAction::Stop => "stop",
                TtlAction::Pause => "pause",
            };
            format!("{idle}/{t}s {action}")
        }
        None => format!("{idle}/-"),
    }
}

/// `age/ttl_total` for `dsec ps`, e.g. `40s/3600s`, or `-`.
pub fn total_ttl_column(s: &SandboxInfo) -> String {
    match s.ttl_total {
        Some(t) => {
            let age = secs_since(&s.created_at).map_or("?".to_string(), |v| format!("{v}s"));
            format!("{age}/{t}s")
        }
        None => "-".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_times() {
        assert!(secs_since("1970-01-01T00:00:00Z").unwrap() > 1_700_000_000);
        assert!(secs_since("garbage").is_none());
        let info = SandboxInfo {
            ttl_running_stop: Some(30),
            ttl_action: TtlAction::Pause,
            last_request_at: Some("2000-01-01T00:00:00Z".into()),
            ..Default::default()
        };
        assert!(idle_ttl_column(&info).ends_with("/30s pause"));
        assert_eq!(total_ttl_column(&info), "-");
    }
}
